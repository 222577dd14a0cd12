"""`zlm serve`'s HTTP API, served in-process on a free loopback port.

The numbers are the commands': a streamed sample is `zlm sample --seed`'s text, a score is
`zlm score --json`'s, /v1/model is `zlm info --json`'s. Bad input: 413 past the body limit,
422 naming the field (malformed JSON, wrong types and ranges, unknown fields, characters
outside the vocabulary), 401 without the token, 503 with Retry-After past --max-streams.
A client that disconnects - streamed or not - frees its slot at once, and nothing in a
request reaches the file system.
"""

from __future__ import annotations

import json
import socket
import sys
import threading

import pytest
from serve_fixtures import Client, build_app, tiny_run
from typer.testing import CliRunner

from zlm.cli import app as cli_app
from zlm.serve.server import ServerThread
from zlm.tools.info import describe


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("serve-http"))


@pytest.fixture(scope="module")
def client(run):
    app, _ = build_app(run, max_streams=3, max_length=100_000, max_body=4096)
    with ServerThread(app) as url:
        yield Client(url)


def _cli(*args: str) -> str:
    res = CliRunner().invoke(cli_app, list(args))
    assert res.exit_code == 0, res.output
    return res.output


def test_a_streamed_sample_is_zlm_samples_text(client, run):
    body = {"prime": "ROMEO:", "length": 300, "temperature": 0.8, "top_p": 0.95, "seed": 42}
    status, headers, data = client.post("/v1/sample", body)
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert headers["transfer-encoding"] == "chunked" and headers["x-zlm-seed"] == "42"
    printed = _cli("sample", str(run), "--prime", "ROMEO:", "--length", "300", "--temperature", "0.8",
                   "--top-p", "0.95", "--seed", "42")
    assert "ROMEO:" + data.decode() + "\n" == printed
    status, whole = client.json("POST", "/v1/sample", {**body, "stream": False})
    assert status == 200 and whole["text"] == data.decode() and whole["finish_reason"] == "length"
    assert whole["seed"] == 42 and whole["tokens"] == whole["characters"] == 300
    expected = json.loads(_cli("sample", str(run), "--prime", "ROMEO:", "--length", "300", "--temperature",
                               "0.8", "--top-p", "0.95", "--seed", "42", "--json"))
    assert whole["nats"] == pytest.approx(expected["nats"], rel=1e-6)


def test_server_sent_events_and_stop_sequences(client):
    body = {"prime": "the ", "length": 400, "seed": 3}
    status, _, plain = client.post("/v1/sample", body)
    text = plain.decode()
    status, headers, data = client.post("/v1/sample", body, {"Accept": "text/event-stream"})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = data.decode().split("\n\n")[:-1]
    pieces = [json.loads(e.removeprefix("data: "))["text"] for e in events[:-1]]
    assert "".join(pieces) == text
    kind, done = events[-1].split("\n")
    assert kind == "event: done" and json.loads(done.removeprefix("data: "))["text"] == text
    stop = text[150:153]
    status, cut = client.json("POST", "/v1/sample", {**body, "stream": False, "stop": [stop, "\x00"]})
    assert cut["text"] == text[: text.index(stop)] and cut["finish_reason"] == "stop"
    status, _, streamed = client.post("/v1/sample", {**body, "stop": stop})
    assert streamed.decode() == cut["text"]
    client.wait_streams(0)


def test_openai_completions(client, run):
    body = {"model": "anything", "prompt": "ROMEO:", "max_tokens": 50, "seed": 5, "temperature": 0.9,
            "user": "ignored"}
    status, out = client.json("POST", "/v1/completions", body)
    assert status == 200 and out["object"] == "text_completion" and out["model"] == run.name
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "length" and choice["index"] == 0 and choice["logprobs"] is None
    assert out["usage"] == {"prompt_tokens": 6, "completion_tokens": 50, "total_tokens": 56}
    _, sampled = client.json("POST", "/v1/sample", {"prime": "ROMEO:", "length": 50, "seed": 5,
                                                    "temperature": 0.9, "stream": False})
    assert choice["text"] == sampled["text"]
    status, headers, data = client.post("/v1/completions", {**body, "stream": True, "echo": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    lines = [x for x in data.decode().split("\n\n") if x]
    assert all(x.startswith("data: ") for x in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(x.removeprefix("data: ")) for x in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "ROMEO:" + choice["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    status, models = client.json("GET", "/v1/models")
    assert models["data"][0]["id"] == run.name
    status, err = client.json("POST", "/v1/completions", {"prompt": "a", "n": 2})
    assert status == 422 and err["error"]["param"] == "n"


def test_score_is_zlm_scores_json(client, run, tmp_path):
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n"
    status, out = client.json("POST", "/v1/score", {"text": text, "top_k": 3})
    assert status == 200
    (tmp_path / "t.txt").write_text(text)
    rows = [json.loads(line) for line in _cli("score", str(run), str(tmp_path / "t.txt"), "--json",
                                              "--top-k", "3").splitlines()]
    assert out["characters"] == rows[:-1]
    want = rows[-1]["summary"]
    assert {k: v for k, v in out["summary"].items() if k != "source"} == \
        {k: v for k, v in want.items() if k != "source"}


def test_model_and_health(client, run):
    status, info = client.json("GET", "/v1/model")
    expected = describe(run)
    assert status == 200 and {k: info[k] for k in expected} == json.loads(json.dumps(expected))
    assert info["server"]["max_streams"] == 3 and info["server"]["kernel"] == "decode"
    status, health = client.json("GET", "/healthz")
    assert health == {"status": "ok", "streams": 0, "max_streams": 3, "auth": False}


@pytest.mark.parametrize(("body", "field", "words"), [
    (b'{"prime": "a", ', "body", "not valid JSON"),
    (b"[1, 2]", "body", "expected a JSON object, got an array"),
    (b"\xff\xfe", "body", "not UTF-8"),
    ({"temperature": "hot"}, "temperature", "expected a number, got a string"),
    ({"temperature": -1}, "temperature", "must be from 0 to 100, got -1"),
    ({"length": 0}, "length", "must be from 1 to 100000, got 0"),
    ({"length": 100_001}, "length", "must be from 1 to 100000"),
    ({"length": 2.5}, "length", "expected an integer, got a number"),
    ({"top_p": 0}, "top_p", "must be in (0, 1], got 0"),
    ({"top_k": True}, "top_k", "expected an integer, got a boolean"),
    ({"seed": -3}, "seed", "must be from 0 to"),
    ({"stream": "yes"}, "stream", "expected true or false"),
    ({"prime": 7}, "prime", "expected a string, got an integer"),
    ({"unknown": "drop"}, "unknown", "must be one of error, replace"),
    ({"stop": [1]}, "stop", "expected a string or an array of strings"),
    ({"path": "/etc/passwd"}, "path", "unknown field"),
])
def test_malformed_requests_are_422_naming_the_field(client, body, field, words):
    status, out = client.json("POST", "/v1/sample", body)
    err = out["error"]
    assert status == 422 and err["param"] == field and words in err["message"], err
    assert err["message"].startswith(field + ":") and "\n" not in err["message"]


def test_characters_outside_the_vocabulary(client):
    status, out = client.json("POST", "/v1/sample", {"prime": "caf\u00e9 \u20ac", "length": 5})
    msg = out["error"]["message"]
    assert status == 422 and out["error"]["param"] == "prime"
    assert "2 characters outside the model's vocabulary: '\u00e9' (U+00E9), '\u20ac' (U+20AC)" in msg
    assert '"unknown": "replace"' in msg
    status, out = client.json("POST", "/v1/sample", {"prime": "caf\u00e9", "length": 5, "unknown": "replace",
                                                     "stream": False, "seed": 1})
    assert status == 200 and out["prime"] == "caf\u00e9" and len(out["text"]) == 5
    status, out = client.json("POST", "/v1/score", {"text": "na\u00efve"})
    assert status == 422 and out["error"]["param"] == "text" and "U+00EF" in out["error"]["message"]
    status, out = client.json("POST", "/v1/score", {"text": "na\u00efve", "unknown": "replace"})
    assert status == 200 and [c["char"] for c in out["characters"]] == list("na\u00efve")
    status, out = client.json("POST", "/v1/score", {"text": ""})
    assert status == 422 and out["error"]["param"] == "text"


def test_bodies_over_the_limit_are_413(client):
    status, out = client.json("POST", "/v1/sample", {"prime": "a" * 5000})
    assert status == 413 and "limit of 4,096 bytes" in out["error"]["message"]
    # chunked, no Content-Length: counted as it is read
    sock = socket.create_connection((client.host, client.port), timeout=30)
    with sock:
        sock.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(3):
            sock.sendall(b"800\r\n" + b"a" * 0x800 + b"\r\n")
        sock.sendall(b"0\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 413")


def test_a_client_that_disconnects_frees_its_slot_at_once(client):
    sock = client.open_stream({"length": 100_000, "seed": 1})
    assert client.streams_in_use() == 1
    sock.close()
    assert client.wait_streams(0, within=1.0) < 0.5
    # a whole (not streamed) response: the disconnect is watched for while it is made
    sock = socket.create_connection((client.host, client.port), timeout=30)
    payload = json.dumps({"length": 100_000, "stream": False}).encode()
    sock.sendall(b"POST /v1/sample HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
    client.wait_streams(1)
    sock.close()
    assert client.wait_streams(0, within=1.0) < 0.5


def test_past_max_streams_is_503_with_retry_after(client):
    held = [client.open_stream({"length": 100_000, "seed": i}) for i in range(3)]
    try:
        status, headers, data = client.post("/v1/sample", {"length": 5})
        assert status == 503 and headers["retry-after"] == "1"
        assert "all 3 streams are busy" in json.loads(data)["error"]["message"]
        status, _, _ = client.post("/v1/completions", {"prompt": "a"})
        assert status == 503
    finally:
        for sock in held:
            sock.close()
    client.wait_streams(0)
    assert client.post("/v1/sample", {"length": 5})[0] == 200


def test_the_time_limit_ends_a_generation(run):
    app, _ = build_app(run, max_length=10**7, timeout=0.2)
    with ServerThread(app) as url:
        c = Client(url)
        status, out = c.json("POST", "/v1/sample", {"length": 10**7, "stream": False})
        assert status == 200 and out["finish_reason"] == "time" and 0 < out["tokens"] < 10**7
        assert c.streams_in_use() == 0


def test_a_token_is_required_on_the_api(run):
    app, _ = build_app(run, token="s3cret")
    with ServerThread(app) as url:
        anon, wrong, right = Client(url), Client(url, "nope"), Client(url, "s3cret")
        for c in (anon, wrong):
            for method, path in (("GET", "/v1/model"), ("POST", "/v1/sample"), ("POST", "/v1/score"),
                                 ("POST", "/v1/completions"), ("GET", "/v1/models")):
                status, headers, data = c.request(method, path, {})
                assert status == 401 and headers["www-authenticate"] == "Bearer", (method, path)
        assert right.json("POST", "/v1/sample", {"length": 3, "stream": False})[0] == 200
        assert anon.get("/")[0] == 200 and anon.json("GET", "/healthz")[1]["auth"] is True


def test_nothing_in_a_request_reaches_the_file_system(client, tmp_path):
    """Every file the server process opens while it answers requests full of paths."""
    marker = tmp_path / "never-opened.txt"
    opened: list[str] = []
    watching = threading.Event()

    def hook(event: str, args) -> None:
        if watching.is_set() and event in ("open", "os.listdir", "os.scandir", "os.remove", "shutil.copyfile"):
            opened.append(f"{event} {args[0]!r}")

    sys.addaudithook(hook)
    watching.set()
    try:
        p = str(marker)
        for path, body in (("/v1/sample", {"prime": p, "length": 20, "stream": False}),
                           ("/v1/sample", {"prime": "../" * 8 + "etc/passwd", "length": 5}),
                           ("/v1/score", {"text": p}), ("/v1/completions", {"prompt": p, "max_tokens": 5}),
                           ("/v1/sample", {"file": p}), ("/v1/model", None)):
            status, _, _ = client.request("POST" if body is not None else "GET", path, body)
            assert status in (200, 422)
        client.get(f"/{p}")
        client.get("/../../etc/passwd")
    finally:
        watching.clear()
    assert not marker.exists()
    assert not [x for x in opened if "never-opened" in x or "passwd" in x]
    assert not opened, opened
