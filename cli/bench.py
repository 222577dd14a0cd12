"""`zlm bench`: cell throughput against torch.nn.LSTM, measured in this process.

Parses options, builds a `zlm.bench.BenchConfig`, calls `zlm.bench.run_bench`, renders:
a table on a terminal, plain lines when stdout is not a TTY or NO_COLOR is set, one JSON
object with --json.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from zlm.cli.render import handle_errors, use_rich


@handle_errors
def command(
    hidden: Annotated[int, typer.Option(help="LSTM units.")] = 512,
    batch_size: Annotated[int, typer.Option(help="Parallel streams per window.")] = 32,
    bptt: Annotated[int, typer.Option(help="Timesteps per window.")] = 100,
    vocab: Annotated[int, typer.Option(help="Vocabulary size of the character LM.")] = 65,
    embed: Annotated[int, typer.Option(help="Embedding width fed to the LSTM.")] = 64,
    device: Annotated[str, typer.Option(help="cpu | cuda.")] = "cpu",
    repeats: Annotated[int, typer.Option(help="Timed rounds per size (the median is shown).")] = 5,
    warmup: Annotated[int, typer.Option(help="Untimed calls per implementation first.")] = 2,
    grid: Annotated[bool, typer.Option(
        "--grid", help="The standard grid: batch 32 and 128 x hidden 256, 512, 1000, bptt 100, "
                       "plus batch-1 sampling at hidden 512.")] = False,
    sample: Annotated[bool, typer.Option(
        "--sample", help="Also time batch-1 sampling (one character per call) at --hidden.")] = False,
    sample_chars: Annotated[int, typer.Option(help="Characters per timed sampling round.")] = 300,
    precision: Annotated[str, typer.Option(
        help="auto, fp32, bf16, or fp16 (CUDA) autocast, or a list: fp32,bf16. "
             "bf16 rows compare with nn.LSTM under plain torch.autocast.")] = "fp32",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Characters/s of nn.LSTM, the reference and the fused cell: training and inference."""
    from zlm.tools.bench import BenchConfig, run_bench

    precisions = tuple(p.strip() for p in precision.split(",") if p.strip()) or ("fp32",)
    configs = [BenchConfig(hidden=hidden, batch_size=batch_size, bptt=bptt, vocab=vocab, embed=embed, device=device,
                           repeats=repeats, warmup=warmup, sample_chars=sample_chars, precision=p)
               for p in precisions]  # each checked before anything runs
    config = configs[0]
    rich = use_rich() and not as_json
    if rich:
        from rich.console import Console

        with Console().status("benchmarking (nn.LSTM, reference, fused, in rotating order)"):
            result = run_bench(config, grid=grid, sample=sample, precisions=precisions)
    else:
        result = run_bench(config, grid=grid, sample=sample, precisions=precisions)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        _render(result, rich)


def _groups(rows: list[dict]) -> list[tuple[tuple, dict[str, dict]]]:
    """Rows grouped by (precision, batch, hidden, bptt, phase), in order: {impl: row}."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r.get("precision", "fp32"), r["batch_size"], r["hidden"], r["bptt"], r["phase"])
        groups.setdefault(key, {})[r["impl"]] = r
    return list(groups.items())


def _impls(rows: list[dict]) -> list[str]:
    """Implementations in the order they first appear (fused+graphs only on CUDA)."""
    return list(dict.fromkeys(r["impl"] for r in rows))


def _cell(by: dict[str, dict], impl: str, key: str, fmt: str) -> str:
    return format(by[impl][key], fmt) if impl in by else "-"


def _render(result: dict, rich: bool) -> None:
    head = (f"device {result['device']}, {result['threads']} threads, torch {result['torch']}; "
            f"fused = {result['fused_cell']}")
    note = ("x = time per character relative to nn.LSTM in this run (lower is faster); "
            "model = whole training step (embedding, LSTM, decoder, loss, backward, clip, Adam)")
    shares = [f"{r.get('precision', 'fp32')} B={r['batch_size']} H={r['hidden']} {r['mask_draw_share']:.1%}"
              for r in result["rows"] if "mask_draw_share" in r]
    if shares:
        note += "\nzoneout mask draw, share of the fused model step: " + ", ".join(shares)
    if result.get("load_warning"):
        note += f"\n{result['load_warning']}"
    impls = _impls(result["rows"])
    others = [i for i in impls if i != "nn.LSTM"]
    if not rich:
        typer.echo(head)
        for (prec, b, h, t, phase), by in _groups(result["rows"]):
            ratios = "  ".join(f"{i} x{_cell(by, i, 'ratio_to_lstm', '.2f')}" for i in others if i in by)
            speeds = "  ".join(f"{i} {_cell(by, i, 'chars_per_s', ',.0f')}" for i in impls if i in by)
            typer.echo(f"{prec} B={b} H={h} T={t} {phase}: {ratios}  |  chars/s: {speeds}")
        typer.echo(note)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="zlm bench", caption=f"{head}\n{note}")
    for col in ("precision", "B", "H", "T", "phase"):
        table.add_column(col, justify="left" if col in ("precision", "phase") else "right")
    for i in others:
        table.add_column(f"{i} x", justify="right")
    for i in impls:
        table.add_column(f"{i} chars/s", justify="right")
    for (prec, b, h, t, phase), by in _groups(result["rows"]):
        ratios = [_cell(by, i, "ratio_to_lstm", ".2f") for i in others]
        speeds = [_cell(by, i, "chars_per_s", ",.0f") for i in impls]
        table.add_row(prec, str(b), str(h), str(t), phase, *ratios, *speeds)
    Console().print(table)
