"""`zlm serve RUN_OR_CHECKPOINT`: parse options, load the model, serve it over HTTP.

The server (`zlm.serve`) samples with continuous batching on `zlm sample`'s decode path,
scores as `zlm score` does, answers OpenAI completions requests, and serves a playground
page at /. Here the command hands it what lives above it: `zlm info`'s description of the
run and `zlm score --html`'s colours. It binds 127.0.0.1 unless told otherwise, and warns
when told otherwise. docs/serve.md describes the API.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from zlm.cli.render import handle_errors
from zlm.errors import UsageError


@handle_errors
def command(
    run: Annotated[Path, typer.Argument(
        help="A RUN_DIR (its best/, else its latest complete checkpoint) or a checkpoint "
             "directory.", metavar="RUN_OR_CHECKPOINT", show_default=False)],
    host: Annotated[str, typer.Option(
        help="Address to listen on; anything but a loopback address is reachable from other "
             "machines (a warning is printed).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port; 0 picks a free one (printed).")] = 8000,
    max_streams: Annotated[int, typer.Option(
        help="Generations at once (the batch); past it requests get 503 with Retry-After.")] = 32,
    max_length: Annotated[int, typer.Option(help="Most tokens one request may ask for.")] = 4000,
    max_body: Annotated[int, typer.Option(
        help="Largest request body in bytes (prime, text to score); larger gets 413.")] = 65536,
    timeout: Annotated[float, typer.Option(
        help="Seconds one generation may run; then it ends (finish_reason \"time\").")] = 120.0,
    token: Annotated[str | None, typer.Option(
        help="Require `Authorization: Bearer TOKEN` on every /v1/ path (401 otherwise).",
        envvar="ZLM_SERVE_TOKEN", show_default=False)] = None,
    precision: Annotated[str, typer.Option(
        help="Sampling, as zlm sample: auto | fp32 | bf16 (scores are always fp32, as zlm "
             "score's).")] = "auto",
    device: Annotated[str, typer.Option(help="auto | cpu | cuda.")] = "auto",
) -> None:
    """Serve a model over HTTP: streamed sampling, scoring, OpenAI completions, a playground."""
    _check(port, max_streams, max_length, max_body, timeout, token)
    try:
        from zlm.serve.server import is_loopback
    except ImportError as e:  # starlette or uvicorn: the serve extra
        raise UsageError(f"zlm serve needs {e.name or 'starlette and uvicorn'}: pip install 'zlm[serve]'") from None

    if not is_loopback(host):
        typer.echo(f"warning: --host {host} makes the server reachable from other machines; "
                   "anyone who can reach it can use it" + ("" if token else " (pass --token)"), err=True)
    _serve(run, host, port, max_streams, max_length, max_body, timeout, token, precision, device)


def _check(port: int, max_streams: int, max_length: int, max_body: int, timeout: float, token) -> None:
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be from 0 to 65535, got {port}")
    if not 1 <= max_streams <= 1024:
        raise UsageError(f"--max-streams must be from 1 to 1024, got {max_streams}")
    if max_length < 1:
        raise UsageError(f"--max-length must be >= 1, got {max_length}")
    if max_body < 1024:
        raise UsageError(f"--max-body must be >= 1024 bytes, got {max_body}")
    if not timeout > 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {timeout}")
    if token is not None and (not token or any(c.isspace() for c in token)):
        raise UsageError("--token must be non-empty, without spaces")


def _serve(run, host, port, max_streams, max_length, max_body, timeout, token, precision, device) -> None:
    from zlm.cli.heatmap import COLOURS, CONTEXT, EDGES, INK, legend_labels
    from zlm.serve.app import Settings, create_app
    from zlm.serve.engine import Engine, ModelThread
    from zlm.serve.page import Palette
    from zlm.serve.server import bind, load_models, serve, url_of
    from zlm.tools.info import describe

    info = describe(run)
    sock = bind(host, port)  # before the model loads: a taken port fails at once
    thread = ModelThread()  # loads the model where it will run
    sample_lm, score_lm = thread.run(load_models, run, device, precision)
    palette = Palette(EDGES, COLOURS, INK, CONTEXT, tuple(legend_labels()))
    name = Path(info["path"]).resolve().name
    settings = Settings(name, info, palette, score_lm, max_length, max_body, token)
    engine = Engine(sample_lm, max_streams, timeout, thread=thread)
    engine.prepare()  # ready before it says so
    url = url_of(sock)
    typer.echo(f"serving {info['checkpoint']} at {url}/ (playground), API under {url}/v1/; "
               f"{max_streams} streams, {sample_lm.runtime.describe()}; Ctrl-C stops", err=False)
    try:
        serve(create_app(engine, settings), sock)
    except KeyboardInterrupt:  # uvicorn shut down gracefully, then re-raised the signal
        typer.echo("stopped", err=True)
