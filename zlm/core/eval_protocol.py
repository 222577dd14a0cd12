"""Scoring a token sequence: summed NLL with the LSTM state carried across it.

Owns the evaluation protocol (`EvalProtocol`) and the scoring loop that training's
validation and `zlm eval` (`zlm.inference.evaluate`) share (`evaluate_predictions`,
`evaluate_tokens`).

Protocol (printed with every result): the text's N tokens give N-1 predictions. They
are cut into S contiguous streams of L = (N-1) // S predictions, evaluated in parallel
in windows of `bptt` tokens with the state carried from window to window and never
reset; the last stream then continues, state carried, over the remaining (N-1) - S*L
predictions. Every prediction is counted exactly once. A split's first token is context
only (it continues the previous split); a text (`--file`, `evaluate_text`) is preceded
by one newline token as context, so every one of its characters is predicted and char,
byte and subword models of the same text are scored over the same character count.

A stream that starts from a zero state pays a cold start: for a model trained with state
resets, the excess loss of its first ~100 characters, about 5 bits (measured:
docs/inference.md; a model trained without them can get lost from a zero state for the
rest of the stream, wherever it starts, context or not). So before its stretch each
stream after the first reads the `stream_context` tokens that precede it (at most its
stretch's length L) as context, not scored, and enters its stretch with the state they
leave: S streams then score what one stream does, up to float rounding and what the LSTM
would have remembered from further back. The first stream starts where one stream does,
from a zero state after the split's first token. With stream_context 0 every stream starts
cold, for a model trained with resets within the documented bound (`cold_start_bound`,
checked by tests/inference/test_evaluate.py) of 50 bits per extra stream. For the exact
single-stream number pass --batch-size 1.

A sample (`EvalProtocol.sample`, training's `--eval-tokens`) scores fewer predictions with
the same streams: each of the S streams starts where it would for the whole text and
scores only the first sample // S predictions of its stretch (no tail), so the sample is S
pieces spread evenly over the text, the same pieces every time. Its characters and bytes
are the text's per prediction times its predictions (exact for the char tokenizer).

Under DDP the streams are divided among ranks and the sums are all-reduced, so the
result does not depend on the world size.

On CUDA each window shape's forward and loss are replayed from a CUDA graph (`WindowStep`):
one launch per window instead of a few per timestep; the eager forward is the reference
(tests/inference/test_evaluate.py checks the replay path against it bit for bit on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from zlm.core.graphs import WindowStep
from zlm.core.metrics import Score
from zlm.core.precision import Runtime
from zlm.data.streams import read_window
from zlm.errors import UsageError
from zlm.model.lm import NLL_BLOCK, ZoneoutLM, blocked_nll

COLD_START_BITS = 50.0  # bound on the total excess bits of one extra stream's cold start
STREAM_CONTEXT = 256  # tokens of context each stream after the first reads before its stretch


def cold_start_bound(streams: int, characters: int) -> float:
    """The most BPC that `streams` parallel streams may add over one stream on a text of
    `characters` characters: COLD_START_BITS per extra stream, spread over the text."""
    return COLD_START_BITS * max(streams - 1, 0) / max(characters, 1)


@dataclass(frozen=True)
class EvalProtocol:
    """How a text is cut into streams and windows."""

    streams: int = 16  # parallel streams S (fewer if the text is short); --batch-size
    bptt: int = 256  # window length; the state is carried across windows; --bptt
    sample: int = 0  # score at most this many predictions, spread over the text (0: all); --eval-tokens
    stream_context: int = STREAM_CONTEXT  # tokens read before each later stream's stretch; --stream-context

    def __post_init__(self):
        if self.streams < 1:
            raise UsageError(f"--batch-size (parallel streams) must be >= 1, got {self.streams}")
        if self.bptt < 1:
            raise UsageError(f"--bptt must be >= 1, got {self.bptt}")
        if self.sample < 0:
            raise UsageError(f"--eval-tokens must be >= 0 (0: the whole split), got {self.sample}")
        if self.stream_context < 0:
            raise UsageError(f"--stream-context must be >= 0 (0: every stream starts from a zero state), "
                             f"got {self.stream_context}")

    def describe(self, n_predictions: int, context: str = "") -> str:
        S = self.streams_for(n_predictions)
        what = f"; {context}" if context else ""
        W = self.stream_context_for(n_predictions)
        warm = (f", each after the first from the {W:,} tokens before it (context, not scored)" if W
                else ", each from a zero state" if S > 1 else "")
        return (f"{S} parallel streams of {n_predictions // S:,} predictions{warm}, state carried "
                f"across {self.bptt}-token windows, never reset; {n_predictions:,} predictions"
                f"{what}")

    def streams_for(self, n_predictions: int) -> int:
        return max(1, min(self.streams, n_predictions))

    def stream_context_for(self, n_predictions: int) -> int:
        """Context tokens each stream after the first reads before its stretch:
        `stream_context`, at most the stretch's length L (so it never reaches before the
        text), 0 for one stream."""
        S = self.streams_for(n_predictions)
        return 0 if S == 1 else min(self.stream_context, n_predictions // S)

    def per_stream(self, n_predictions: int) -> int:
        """Predictions each stream scores: its whole stretch L = n // S, or its first
        sample // S when the sample is smaller than the text (at least one)."""
        S = self.streams_for(n_predictions)
        L = n_predictions // S
        return L if not self.sample or self.sample >= n_predictions else max(1, min(L, self.sample // S))


def _windows(tokens: np.ndarray, starts: np.ndarray, length: int, bptt: int, dev):
    """(inputs, targets), each (T, B), for streams at `starts` of `length` predictions.

    Reads one window at a time from `tokens` (a memory map is fine), so memory does not
    grow with the length of the split.
    """
    for s in range(0, length, bptt):
        T = min(bptt, length - s)
        window = read_window(tokens, starts, s, T).to(dev)  # (T+1, B)
        yield window[:-1], window[1:]


@torch.no_grad()
def warm_states(model: ZoneoutLM, tokens: np.ndarray, starts: np.ndarray, protocol: EvalProtocol,
                runtime: Runtime, bptt: int | None = None):
    """The state (h, c), each (layers, B, H), of the protocol's streams of `tokens` that
    start at `starts` (B,) after reading the W = `protocol.stream_context_for(n)` tokens
    before their starts as context (windows of `bptt`, the protocol's by default; nothing
    scored); a stream starting before W (the text's first) keeps the zero state. None when
    W is 0: the model's initial state."""
    width = protocol.stream_context_for(len(tokens) - 1)
    if width < 1:
        return None
    bptt = bptt or protocol.bptt
    dev = runtime.device
    state = model.initial_state(len(starts), dev, model.embedding.weight.dtype)
    begin = np.maximum(starts - width, 0)
    for s in range(0, width, bptt):
        T = min(bptt, width - s)
        inputs = read_window(tokens, begin, s, T - 1).to(dev)  # (T, B): the tokens before the start
        with runtime.autocast():
            _, state = model.features(inputs, state)
    cold = torch.from_numpy(starts < width).to(dev)[None, :, None]
    return tuple(torch.where(cold, torch.zeros((), dtype=t.dtype, device=dev), t).contiguous() for t in state)


def _window_step(model: ZoneoutLM, runtime: Runtime, graphs: bool) -> WindowStep:
    """(inputs, targets, state) -> (summed NLL of the window, final state), in eval mode;
    each window shape (the streams' full and last windows, the tail stream's) replayed from
    a CUDA graph with `graphs` (a failed capture warns and evaluates eagerly). On a CPU the
    decoder and the loss run over blocks of rows (`blocked_nll`), which scores a large
    vocabulary faster (docs/speed.md); on CUDA the whole window at once."""
    block = NLL_BLOCK if runtime.device.type == "cpu" else None

    def window(inputs, targets, h0, c0):
        with runtime.autocast(cache=not graphs):  # autocast's weight cache must not outlive a capture
            x, (h, c) = model.features(inputs, (h0, c0))
            nll = blocked_nll(model.decoder, x, targets, block)
        return nll, h, c

    return WindowStep(window, graphs=graphs, fallback="evaluation")


def _run(windows, state, step: WindowStep, model: ZoneoutLM, device) -> tuple[float, tuple]:
    """Sum of NLL over windows, carrying state (one device sync at the end); state None:
    the model's initial state."""
    nats = torch.zeros((), dtype=torch.float64, device=device)
    for inputs, targets in windows:
        if state is None:
            state = model.initial_state(inputs.shape[1], device, model.embedding.weight.dtype)
        nll, state = step(inputs, targets, state)
        nats += nll.double()
    return float(nats), state


@torch.no_grad()
def evaluate_predictions(
    model: ZoneoutLM,
    tokens: np.ndarray,
    runtime: Runtime,
    protocol: EvalProtocol = EvalProtocol(),
    rank: int = 0,
    world: int = 1,
    graphs: bool | None = None,
) -> tuple[float, int]:
    """Summed NLL in nats over this rank's share of the N-1 predictions (of the protocol's
    sample of them), and their count.

    tokens: (N,) any integer dtype; a memory map is read window by window. graphs: replay
    the windows from CUDA graphs (`WindowStep`); None: on CUDA.
    """
    was_training = model.training
    model.eval()
    n = len(tokens) - 1
    if n < 1:
        return 0.0, 0
    S = protocol.streams_for(n)
    L = n // S  # each stream's stretch
    scored = protocol.per_stream(n)  # L, or the sample's share of it
    mine = np.array_split(np.arange(S), world)[rank]  # this rank's stream indices
    dev = runtime.device
    step = _window_step(model, runtime, dev.type == "cuda" if graphs is None else graphs)
    nats, count, state = 0.0, 0, None
    if len(mine):
        state = warm_states(model, tokens, mine * L, protocol, runtime)
        nats, state = _run(_windows(tokens, mine * L, scored, protocol.bptt, dev), state, step, model, dev)
        count = scored * len(mine)
    tail = n - S * L if scored == L else 0
    if tail and len(mine) and mine[-1] == S - 1:  # continue the last stream to the end
        last = (state[0][:, -1:].contiguous(), state[1][:, -1:].contiguous())
        rest = _windows(tokens, np.array([S * L]), tail, protocol.bptt, dev)
        more, _ = _run(rest, last, step, model, dev)
        nats += more
        count += tail
    model.train(was_training)
    return nats, count


def evaluate_tokens(model, tokens, tokenizer, characters: int, n_bytes: int, runtime: Runtime,
                protocol: EvalProtocol = EvalProtocol(), reduce=None, rank=0, world=1) -> Score:
    """Score a whole split, or the protocol's sample of it. characters/n_bytes: of the
    split's original text.

    The first token is context only, so the characters (and bytes) it covers are not
    predicted and not counted; a sample counts the predicted ones' share of them.
    `reduce(list_of_floats) -> list` sums across ranks.
    """
    nats, count = evaluate_predictions(model, tokens, runtime, protocol, rank, world)
    if reduce is not None:
        nats, count = reduce([nats, float(count)])
    return split_score(nats, count, tokens, tokenizer, characters, n_bytes)


def split_score(nats: float, count: int, tokens, tokenizer, characters: int, n_bytes: int) -> Score:
    """The Score of `count` predictions (all, or a sample) of a split's `tokens` whose text
    has `characters` characters and `n_bytes` bytes: the first token's are not predicted,
    and a sample counts its share of the rest."""
    first = tokenizer.decode([int(tokens[0])]) if len(tokens) else ""
    characters = max(characters - len(first), 0)
    n_bytes = max(n_bytes - len(first.encode("utf-8", "replace")), 0)
    predictions = len(tokens) - 1
    if 0 < count < predictions:  # a sample
        characters, n_bytes = round(characters * count / predictions), round(n_bytes * count / predictions)
    return Score(nats=float(nats), tokens=int(count), characters=characters, bytes=n_bytes)
