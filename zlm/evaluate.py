"""Bits per character of a token array, with the LSTM state carried across the text.

Protocol (printed with every result): the text's N tokens give N-1 predictions. They
are cut into S contiguous streams of L = (N-1) // S predictions, evaluated in parallel
in windows of `bptt` tokens with the state carried from window to window and never
reset; the last stream then continues, state carried, over the remaining (N-1) - S*L
predictions. Every prediction is counted exactly once. Each stream starts from a zero
state, so more streams mean more cold starts: S streams cost roughly S times the excess
loss of the first ~100 characters; on a 300k-character split with S = 16 that is below
0.005 BPC (tests/test_evaluate.py measures it). Under DDP the streams are divided among
ranks and the sums are all-reduced, so the result does not depend on the world size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from zlm.metrics import Score
from zlm.model import ZoneoutLM, token_nll
from zlm.precision import Runtime


@dataclass(frozen=True)
class EvalProtocol:
    """How a split is cut into streams and windows."""

    streams: int = 16  # parallel streams S (fewer if the text is short)
    bptt: int = 256  # window length; the state is carried across windows

    def describe(self, n_predictions: int) -> str:
        S = self.streams_for(n_predictions)
        return (f"{S} parallel streams of {n_predictions // S:,} predictions, state carried "
                f"across {self.bptt}-token windows, never reset; {n_predictions:,} predictions")

    def streams_for(self, n_predictions: int) -> int:
        return max(1, min(self.streams, n_predictions))


def _run(model, inputs, targets, state, bptt, runtime) -> tuple[float, tuple]:
    """Sum of NLL over (T, B) inputs/targets in windows, carrying state."""
    nats = 0.0
    for s in range(0, inputs.shape[0], bptt):
        with runtime.autocast():
            logits, state = model(inputs[s : s + bptt], state)
        nats += float(token_nll(logits, targets[s : s + bptt]).double())
    return nats, state


@torch.no_grad()
def score_predictions(
    model: ZoneoutLM,
    tokens: np.ndarray,
    runtime: Runtime,
    protocol: EvalProtocol = EvalProtocol(),
    rank: int = 0,
    world: int = 1,
) -> tuple[float, int]:
    """Summed NLL in nats over this rank's share of the N-1 predictions, and their count.

    tokens: (N,) any integer dtype (a memory map is fine: read window by window).
    """
    was_training = model.training
    model.eval()
    n = len(tokens) - 1
    if n < 1:
        return 0.0, 0
    S = protocol.streams_for(n)
    L = n // S
    mine = np.array_split(np.arange(S), world)[rank]  # this rank's stream indices
    dev = runtime.device
    nats, count, state = 0.0, 0, None
    if len(mine):
        starts = mine * L  # (B,)
        idx = starts[None, :] + np.arange(L + 1)[:, None]  # (L+1, B)
        window = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64)).to(dev)
        nats, state = _run(model, window[:-1], window[1:], None, protocol.bptt, runtime)
        count = L * len(mine)
    tail = n - S * L
    if tail and len(mine) and mine[-1] == S - 1:  # continue the last stream to the end
        last = (state[0][:, -1:].contiguous(), state[1][:, -1:].contiguous())
        rest = torch.from_numpy(np.asarray(tokens[S * L :], dtype=np.int64)).to(dev)[:, None]
        more, _ = _run(model, rest[:-1], rest[1:], last, protocol.bptt, runtime)
        nats += more
        count += tail
    model.train(was_training)
    return nats, count


def score_split(model, tokens, tokenizer, characters: int, n_bytes: int, runtime: Runtime,
                protocol: EvalProtocol = EvalProtocol(), reduce=None, rank=0, world=1) -> Score:
    """Score a whole split. characters/n_bytes: of the split's original text.

    The first token is context only, so the characters (and bytes) it covers are not
    predicted and not counted. `reduce(list_of_floats) -> list` sums across ranks.
    """
    nats, count = score_predictions(model, tokens, runtime, protocol, rank, world)
    if reduce is not None:
        nats, count = reduce([nats, float(count)])
    first = tokenizer.decode([int(tokens[0])]) if len(tokens) else ""
    return Score(
        nats=float(nats),
        tokens=int(count),
        characters=max(characters - len(first), 0),
        bytes=max(n_bytes - len(first.encode("utf-8", "replace")), 0),
    )
