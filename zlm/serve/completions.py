"""POST /v1/completions in OpenAI's completions format, so that existing clients work.

Request: prompt (a string, or an array of one), max_tokens (default 16), temperature,
top_p, seed, stream, stop, echo; top_k and unknown as in /v1/sample. n, best_of,
logprobs, presence_penalty, frequency_penalty and suffix are accepted at their neutral
values only; other fields (model, user, ...) are ignored, as clients send some.

Reply: {"id", "object": "text_completion", "created", "model", "choices": [{"text",
"index": 0, "logprobs": null, "finish_reason"}], "usage": {...}}; streamed, one such
object per piece on a `data:` line (the last with its finish_reason), then `data: [DONE]`.
finish_reason is "length" or "stop" as OpenAI's; "time" when the server's per-request
limit ended it.
"""

from __future__ import annotations

import json
import secrets
import time

from zlm.inference.sample import SampleConfig
from zlm.serve.params import MAX_SEED, UNKNOWN, BadRequest, Fields, SampleRequest, kind_of

# Fields that change nothing here when left at these values.
NEUTRAL = {"n": 1, "best_of": 1, "logprobs": None, "presence_penalty": 0, "frequency_penalty": 0,
           "suffix": None}


def parse(body: dict, max_length: int) -> tuple[SampleRequest, bool]:
    """The request, and whether to echo the prompt."""
    f = Fields(body)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest(f"prompt: expected a string (or an array of one), got {kind_of(prompt)}", "prompt")
    for name, neutral in NEUTRAL.items():
        if body.get(name, neutral) not in (neutral, None):
            raise BadRequest(f"{name}: only {json.dumps(neutral)} is supported here, got "
                             f"{json.dumps(body[name])}", name)
    cfg = SampleConfig(
        prime=prompt, length=f.integer("max_tokens", min(16, max_length), 1, max_length),
        temperature=f.number("temperature", 1.0, 0.0, 100.0),
        top_k=f.integer("top_k", None, 0, 1 << 30, null=True),
        top_p=f.number("top_p", None, 0.0, 1.0, lo_open=True, null=True),
        seed=f.integer("seed", None, 0, MAX_SEED, null=True), unknown=f.choice("unknown", "error", UNKNOWN),
        prime_flag="prompt")
    return SampleRequest(cfg, f.boolean("stream", False), f.stops("stop")), f.boolean("echo", False)


class Reply:
    """The response objects of one completion."""

    def __init__(self, model: str, prompt: str, echo: bool, prompt_tokens: int):
        self.id = f"cmpl-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.model, self.prompt, self.echo = model, prompt, echo
        self.prompt_tokens = prompt_tokens if prompt else 0  # an empty prompt: a newline as context

    def _obj(self, text: str, reason: str | None) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": reason}]}

    def whole(self, text: str, reason: str, tokens: int) -> dict:
        out = self._obj(self.prompt + text if self.echo else text, reason)
        out["usage"] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": tokens,
                        "total_tokens": self.prompt_tokens + tokens}
        return out

    async def events(self, reading):
        """SSE lines: the echoed prompt, each piece, an empty piece with the finish_reason, [DONE]."""
        if self.echo and self.prompt:
            yield _data(self._obj(self.prompt, None))
        async for piece in reading:
            yield _data(self._obj(piece, None))
        yield _data(self._obj("", reading.reason))
        yield "data: [DONE]\n\n"


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
