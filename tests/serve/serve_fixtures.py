"""What the tests of tests/serve share: a tiny trained run, the app built as `zlm serve`
builds it and served in-process on a free loopback port, and a small HTTP client."""

from __future__ import annotations

import http.client
import json
import pathlib
import socket
import time
from urllib.parse import urlsplit

from conftest import shakespeare_text, train_run, write_char_dataset
from zlm.cli.heatmap import COLOURS, CONTEXT, EDGES, INK, legend_labels
from zlm.core.config import TrainConfig
from zlm.data.dataset import Dataset
from zlm.model.lm import ModelConfig
from zlm.serve.app import Settings, create_app
from zlm.serve.engine import Engine, ModelThread
from zlm.serve.page import Palette
from zlm.serve.server import load_models
from zlm.tools.info import describe

PALETTE = Palette(EDGES, COLOURS, INK, CONTEXT, tuple(legend_labels()))


def tiny_run(root: pathlib.Path) -> pathlib.Path:
    """RUN_DIR of a 2 x 32 zoneout char model trained for 10 steps (~1 s); its vocabulary
    holds U+FFFD, so "unknown": "replace" has something to map to."""
    text = shakespeare_text(30_000) + "\ufffd\n"
    data = Dataset.open(write_char_dataset(root / "data", text))
    train_run(root / "run", data, ModelConfig(vocab_size=data.vocab_size, hidden=32, embed=8, layers=2),
              TrainConfig(batch_size=4, bptt=20, max_steps=10, eval_every=10, log_every=100))
    return root / "run"


def build_app(run, max_streams: int = 8, max_length: int = 4000, max_body: int = 65536,
              timeout: float = 120.0, token: str | None = None, kernel: str = "auto"):
    """(app, engine) as `zlm serve` builds them, on the CPU."""
    thread = ModelThread()
    sample_lm, score_lm = thread.run(load_models, run, "cpu", "auto")
    engine = Engine(sample_lm, max_streams, timeout, kernel=kernel, thread=thread)
    settings = Settings(pathlib.Path(run).name, describe(run), PALETTE, score_lm, max_length, max_body, token)
    return create_app(engine, settings), engine


class Client:
    """http.client against one server: JSON in, (status, headers, body) out."""

    def __init__(self, url: str, token: str | None = None):
        parts = urlsplit(url)
        self.host, self.port, self.token = parts.hostname, parts.port, token

    def request(self, method: str, path: str, body=None, headers: dict | None = None):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            if self.token:
                hdrs.setdefault("Authorization", f"Bearer {self.token}")
            conn.request(method, path, body=data, headers=hdrs)
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def post(self, path: str, body=None, headers: dict | None = None):
        return self.request("POST", path, body, headers)

    def get(self, path: str, headers: dict | None = None):
        return self.request("GET", path, None, headers)

    def json(self, method: str, path: str, body=None, headers=None) -> tuple[int, dict]:
        status, _, data = self.request(method, path, body, headers)
        return status, json.loads(data)

    def streams_in_use(self) -> int:
        return self.json("GET", "/healthz")[1]["streams"]

    def wait_streams(self, n: int = 0, within: float = 2.0) -> float:
        """Seconds until /healthz reports `n` streams in use (fails after `within`)."""
        start = time.monotonic()
        while (got := self.streams_in_use()) != n:
            assert time.monotonic() - start < within, f"{got} streams still in use after {within} s"
            time.sleep(0.005)
        return time.monotonic() - start

    def open_stream(self, body: dict) -> socket.socket:
        """A raw connection that has sent a streamed POST /v1/sample and read the response
        head and the first piece of text (the test closes it when it likes)."""
        sock = socket.create_connection((self.host, self.port), timeout=30)
        payload = json.dumps(body).encode()
        auth = f"Authorization: Bearer {self.token}\r\n" if self.token else ""
        sock.sendall(f"POST /v1/sample HTTP/1.1\r\nHost: x\r\nContent-Length: {len(payload)}\r\n{auth}"
                     "Content-Type: application/json\r\n\r\n".encode() + payload)
        got = b""
        while b"\r\n\r\n" not in got or len(got.split(b"\r\n\r\n", 1)[1]) < 3:
            chunk = sock.recv(65536)
            assert chunk, f"the server closed the stream: {got[:300]!r}"
            got += chunk
        assert got.startswith(b"HTTP/1.1 200"), got[:300]
        return sock
