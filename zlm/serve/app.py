"""The HTTP face of `zlm serve`: a Starlette app over one `Engine`.

    GET  /                the playground (zlm/serve/page.py)
    GET  /healthz         {"status": "ok", "streams": in use, "max_streams", "auth"}
    GET  /v1/model        what `zlm info` says about the model, and the server's limits
    GET  /v1/models       the model in OpenAI's list format
    POST /v1/sample       `zlm sample`: streamed as text/plain (or server-sent events with
                          Accept: text/event-stream), or one JSON object with "stream": false
    POST /v1/score        `zlm score --json`: per-character bits and the summary
    POST /v1/completions  OpenAI's completions format (SSE "data:" lines and [DONE] when streamed)

Errors are JSON, {"error": {"message": one line naming the field, "type", "param", "code"}}:
413 for a body over `max_body`, 422 for malformed JSON or parameters (and characters
outside the vocabulary), 401 without the bearer token when one is set (every /v1/ path),
503 with Retry-After when every stream is busy. A client that disconnects frees its slot
at once: a stream's response cancels its generation when the send loop ends, and a whole
response watches for the disconnect while it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from zlm.inference.sample import Sample
from zlm.inference.score import ScoreConfig, score_text_chars
from zlm.serve import completions
from zlm.serve.engine import Busy, Engine, Generation
from zlm.serve.page import Palette, render_page
from zlm.serve.params import BadRequest, encode_text, parse_body, sample_request, score_request

RETRY_AFTER_S = 1


@dataclass(frozen=True)
class Settings:
    """What the app serves and its limits (the engine holds max_streams and the timeout)."""

    name: str  # the model's name in responses (the run directory's name)
    info: dict  # `zlm info --json` of the run
    palette: Palette  # the heat map's colours (`zlm score --html`'s)
    score_lm: object  # the LoadedModel `zlm score` would load (fp32): the same numbers
    max_length: int = 4000  # tokens per request
    max_body: int = 65536  # bytes per request body
    token: str | None = None  # required as `Authorization: Bearer TOKEN` on /v1/ paths
    extra: dict = field(default_factory=dict)  # shown under "server" by /v1/model


def create_app(engine: Engine, settings: Settings) -> Starlette:
    """The app; the engine is started and closed with it (lifespan)."""
    api = _Api(engine, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await engine.start()
        try:
            yield
        finally:
            await engine.close()

    routes = [Route("/", api.page), Route("/healthz", api.health), Route("/v1/model", api.model),
              Route("/v1/models", api.models), Route("/v1/sample", api.sample, methods=["POST"]),
              Route("/v1/score", api.score, methods=["POST"]),
              Route("/v1/completions", api.completions, methods=["POST"])]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={BadRequest: _bad_request, Busy: _busy})
    return BearerAuth(app, settings.token) if settings.token else app


def error_json(message: str, status: int, kind: str, param: str | None = None, headers=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status, headers=headers)


async def _bad_request(request: Request, e: BadRequest) -> Response:
    return error_json(e.message, e.status, "invalid_request_error", e.field)


async def _busy(request: Request, e: Busy) -> Response:
    return error_json(f"{e}; retry in {RETRY_AFTER_S} s", 503, "server_busy",
                      headers={"Retry-After": str(RETRY_AFTER_S)})


class BearerAuth:
    """ASGI middleware: every /v1/ path needs `Authorization: Bearer TOKEN` (401 otherwise);
    the playground page and /healthz do not (the page asks for the token)."""

    def __init__(self, app, token: str):
        self.app, self.expected = app, f"Bearer {token}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                reply = error_json("missing or wrong token: pass the header Authorization: Bearer TOKEN",
                                   401, "authentication_error", headers={"WWW-Authenticate": "Bearer"})
                await reply(scope, receive, send)
                return
        await self.app(scope, receive, send)


class StopScanner:
    """Cuts generated text at the first stop sequence, holding back what could begin one."""

    def __init__(self, stops: list[str]):
        self.stops, self.buf = stops, ""
        self.hold = max((len(s) for s in stops), default=1) - 1

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop sequence was found)."""
        self.buf += piece
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf = self.buf[: min(hits)], ""
            return out, True
        cut = max(len(self.buf) - self.hold, 0)
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


class Reading:
    """A generation's text, stop sequences applied; `reason` once it is over."""

    def __init__(self, engine: Engine, gen: Generation, stops: list[str]):
        self.engine, self.gen, self.scan = engine, gen, StopScanner(stops)
        self.stopped = False

    async def __aiter__(self):
        async for piece in self.gen.pieces():
            out, hit = self.scan.feed(piece)
            if out:
                yield out
            if hit:
                self.stopped = True
                self.engine.cancel(self.gen)
                return
        tail = self.scan.flush()
        if tail:
            yield tail

    @property
    def reason(self) -> str:
        return "stop" if self.stopped else self.gen.finish_reason or "cancelled"


class GenerationResponse(StreamingResponse):
    """A streamed generation: however the response ends (done, the client gone, an
    error), the generation is cancelled with it, which frees its slot."""

    def __init__(self, engine: Engine, gen: Generation, content, **kw):
        super().__init__(content, **kw)
        self.engine, self.gen = engine, gen

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.engine.cancel(self.gen)


async def read_body(request: Request, limit: int) -> dict:
    """The body as a JSON object; 413 past `limit` bytes (by Content-Length, or as read)."""
    declared = request.headers.get("content-length", "")
    too_big = f"body: over this server's limit of {limit:,} bytes (zlm serve --max-body)"
    if declared.isdigit() and int(declared) > limit:
        raise BadRequest(too_big, "body", 413)
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise BadRequest(too_big, "body", 413)
        chunks.append(chunk)
    return parse_body(b"".join(chunks))


async def until_disconnect(receive) -> None:
    """Returns when the client has gone (the body already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def collect(request: Request, reading: Reading) -> str | None:
    """The whole text, or None when the client left first (its generation cancelled)."""

    async def text() -> str:
        return "".join([piece async for piece in reading])

    task = asyncio.ensure_future(text())
    gone = asyncio.ensure_future(until_disconnect(request.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            reading.engine.cancel(reading.gen)
    return task.result() if not task.cancelled() else None


class _Api:
    def __init__(self, engine: Engine, settings: Settings):
        self.engine, self.s = engine, settings
        self.started = time.time()

    async def page(self, request: Request) -> Response:
        return HTMLResponse(render_page(self.s.name, self.s.palette),
                            headers={"Content-Security-Policy": "default-src 'self'; "
                                     "script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "streams": self.engine.in_use,
                             "max_streams": self.engine.max_streams, "auth": self.s.token is not None})

    async def model(self, request: Request) -> Response:
        server = {"max_streams": self.engine.max_streams, "max_length": self.s.max_length,
                  "max_body": self.s.max_body, "timeout_s": self.engine.timeout_s,
                  "precision": self.engine.lm.runtime.precision, "device": str(self.engine.lm.runtime.device),
                  "kernel": self.engine.rows.kernel if self.engine.rows else None, **self.s.extra}
        return JSONResponse({"name": self.s.name, **self.s.info, "server": server})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.s.name, "object": "model", "created": int(self.started), "owned_by": "zlm"}]})

    def _submit(self, req) -> Generation:
        cfg = req.config
        ids = encode_text(self.engine.lm, cfg.prime, cfg.unknown, cfg.prime_flag)
        return self.engine.submit(cfg, ids)

    async def sample(self, request: Request) -> Response:
        req = sample_request(await read_body(request, self.s.max_body), self.s.max_length)
        gen = self._submit(req)
        reading = Reading(self.engine, gen, req.stop)
        headers = {"X-Zlm-Seed": str(gen.seed)}
        if req.stream:
            if "text/event-stream" in request.headers.get("accept", ""):
                return GenerationResponse(self.engine, gen, _sample_events(reading, req.config.prime),
                                          media_type="text/event-stream", headers=headers)
            return GenerationResponse(self.engine, gen, reading, media_type="text/plain; charset=utf-8",
                                      headers=headers)
        text = await collect(request, reading)
        if text is None:
            return Response(status_code=499)  # nobody is listening
        return JSONResponse(_sample_summary(reading, req.config.prime, text), headers=headers)

    async def score(self, request: Request) -> Response:
        req = score_request(await read_body(request, self.s.max_body))
        encode_text(self.s.score_lm, req.text, req.unknown, "text")  # 422 before the model runs
        config = ScoreConfig(top_k=req.top_k, unknown=req.unknown)
        scored = await self.engine.call(score_text_chars, self.s.score_lm, req.text, config, "request")
        return JSONResponse({"characters": [scored.char_dict(i) for i in range(len(scored.text))],
                             "summary": scored.summary()})

    async def completions(self, request: Request) -> Response:
        req, echo = completions.parse(await read_body(request, self.s.max_body), self.s.max_length)
        gen = self._submit(req)
        reading = Reading(self.engine, gen, req.stop)
        reply = completions.Reply(self.s.name, req.config.prime, echo, len(gen.stream.prime_ids))
        if req.stream:
            return GenerationResponse(self.engine, gen, reply.events(reading), media_type="text/event-stream")
        text = await collect(request, reading)
        if text is None:
            return Response(status_code=499)
        return JSONResponse(reply.whole(text, reading.reason, gen.tokens))


def _sample_summary(reading: Reading, prime: str, text: str) -> dict:
    gen = reading.gen
    sample = Sample(prime, text, gen.tokens, gen.nats, gen.seed)
    out = {**sample.to_dict(), "finish_reason": reading.reason}
    if gen.error:
        out["error"] = gen.error
    return out


async def _sample_events(reading: Reading, prime: str):
    """Server-sent events: `data: {"text": ...}` per piece, then `event: done` with the summary."""
    parts = []
    async for piece in reading:
        parts.append(piece)
        yield f"data: {json.dumps({'text': piece}, ensure_ascii=False)}\n\n"
    summary = _sample_summary(reading, prime, "".join(parts))
    yield f"event: done\ndata: {json.dumps(summary, ensure_ascii=False)}\n\n"
