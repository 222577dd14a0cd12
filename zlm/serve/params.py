"""What a request to `zlm serve` may ask, checked field by field.

Every problem is a `BadRequest`: an HTTP status (413 for a body over the limit, 422 for
everything else) and one line that names the field. Nothing in a request names a file:
the fields are numbers, flags and text, and text only ever reaches the tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from zlm.errors import ZlmError
from zlm.inference.sample import SampleConfig, encode_prime

MAX_SEED = 2**63 - 1
MAX_STOPS = 4  # stop sequences per request (the OpenAI limit)
UNKNOWN = ("error", "replace")


class BadRequest(Exception):
    """A request the server refuses: status and one line naming the field."""

    def __init__(self, message: str, field: str | None = None, status: int = 422):
        super().__init__(message)
        self.message, self.field, self.status = message, field, status


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object."""
    try:
        body = json.loads(raw.decode("utf-8") if raw else "")
    except UnicodeDecodeError as e:
        raise BadRequest(f"body: not UTF-8 (byte {e.start})", "body") from None
    except json.JSONDecodeError as e:
        raise BadRequest(f"body: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})",
                         "body") from None
    if not isinstance(body, dict):
        raise BadRequest(f"body: expected a JSON object, got {kind_of(body)}", "body")
    return body


def kind_of(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null", int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


class Fields:
    """Typed reads of a JSON object's fields; each problem a BadRequest naming the field."""

    def __init__(self, body: dict, known: tuple[str, ...] | None = None):
        self.body = body
        if known is not None:
            extra = [k for k in body if k not in known]
            if extra:
                raise BadRequest(f"{extra[0]}: unknown field (this endpoint takes {', '.join(known)})",
                                 extra[0])

    def integer(self, name: str, default, lo: int, hi: int, null: bool = False) -> int | None:
        v = self.body.get(name, default)
        if v is None and null:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            else:
                raise BadRequest(f"{name}: expected an integer, got {kind_of(v)}", name)
        if not lo <= v <= hi:
            raise BadRequest(f"{name}: must be from {lo} to {hi}, got {v}", name)
        return v

    def number(self, name: str, default, lo: float, hi: float, lo_open: bool = False,
               null: bool = False) -> float | None:
        v = self.body.get(name, default)
        if v is None and null:
            return None
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise BadRequest(f"{name}: expected a number, got {kind_of(v)}", name)
        v = float(v)
        if not (lo < v if lo_open else lo <= v) or not v <= hi:
            where = f"in ({lo:g}, {hi:g}]" if lo_open else f"from {lo:g} to {hi:g}"
            raise BadRequest(f"{name}: must be {where}, got {v:g}", name)
        return v

    def boolean(self, name: str, default: bool) -> bool:
        v = self.body.get(name, default)
        if not isinstance(v, bool):
            raise BadRequest(f"{name}: expected true or false, got {kind_of(v)}", name)
        return v

    def text(self, name: str, default: str | None, empty: bool = True) -> str:
        v = self.body.get(name, default)
        if v is None:
            raise BadRequest(f"{name}: required (a string)", name)
        if not isinstance(v, str):
            raise BadRequest(f"{name}: expected a string, got {kind_of(v)}", name)
        if not empty and not v:
            raise BadRequest(f"{name}: empty; pass some text", name)
        return v

    def choice(self, name: str, default: str, choices: tuple[str, ...]) -> str:
        v = self.text(name, default)
        if v not in choices:
            raise BadRequest(f"{name}: must be one of {', '.join(choices)}, got {v!r}", name)
        return v

    def stops(self, name: str) -> list[str]:
        v = self.body.get(name)
        if v is None:
            return []
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise BadRequest(f"{name}: expected a string or an array of strings, got {kind_of(v)}", name)
        if len(items) > MAX_STOPS:
            raise BadRequest(f"{name}: at most {MAX_STOPS} stop sequences, got {len(items)}", name)
        return [s for s in items if s]


@dataclass(frozen=True)
class SampleRequest:
    """A checked request for text: what to generate, how to send it, when to stop early."""

    config: SampleConfig
    stream: bool
    stop: list[str]


SAMPLE_FIELDS = ("prime", "length", "temperature", "top_k", "top_p", "seed", "stream", "unknown", "stop")


def sample_request(body: dict, max_length: int) -> SampleRequest:
    """POST /v1/sample: the fields of `zlm sample`, plus stream and stop."""
    f = Fields(body, SAMPLE_FIELDS)
    cfg = SampleConfig(
        prime=f.text("prime", ""), length=f.integer("length", min(500, max_length), 1, max_length),
        temperature=f.number("temperature", 1.0, 0.0, 100.0),
        top_k=f.integer("top_k", None, 0, 1 << 30, null=True),
        top_p=f.number("top_p", None, 0.0, 1.0, lo_open=True, null=True),
        seed=f.integer("seed", None, 0, MAX_SEED, null=True), unknown=f.choice("unknown", "error", UNKNOWN),
        prime_flag="prime")
    return SampleRequest(cfg, f.boolean("stream", True), f.stops("stop"))


@dataclass(frozen=True)
class ScoreRequest:
    text: str
    top_k: int
    unknown: str


def score_request(body: dict) -> ScoreRequest:
    """POST /v1/score: the text and `zlm score`'s --top-k and --unknown."""
    f = Fields(body, ("text", "top_k", "unknown"))
    return ScoreRequest(f.text("text", None, empty=False), f.integer("top_k", 5, 0, 64),
                        f.choice("unknown", "error", UNKNOWN))


def encode_text(lm, text: str, unknown: str, field: str) -> torch.Tensor:
    """(P,) the token ids of `text` (a prime: `zlm sample`'s encoding, the newline context when
    empty); characters outside a char vocabulary are a BadRequest naming them, or replaced
    by U+FFFD with unknown="replace" where the vocabulary has it."""
    tok = lm.tokenizer
    try:
        if not text:
            return encode_prime(lm, text, unknown, field)
        return torch.from_numpy(tok.encode(text, unknown=unknown))
    except ZlmError as e:
        chars = getattr(tok, "chars", None)
        if chars is None:
            raise BadRequest(f"{field}: {str(e).splitlines()[0]}", field) from None
        known = set(chars)
        bad = sorted({c for c in text if c not in known})
        shown = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in bad[:8]) + (", ..." if len(bad) > 8 else "")
        fix = ('pass "unknown": "replace" to replace them with U+FFFD' if "\ufffd" in known
               else "this vocabulary has no U+FFFD to replace them with; remove them")
        raise BadRequest(f"{field}: {len(bad)} character{'s' * (len(bad) != 1)} outside the model's "
                         f"vocabulary: {shown}; {fix}", field) from None
