"""Training batches from a memory-mapped token array: TBPTT streams and shuffled chunks.

Two protocols, both stateful (`state_dict` / `load_state_dict`) so a resumed run sees
exactly the batches an uninterrupted run would have:

- `CarryStreams` (default): the split is cut into W x B contiguous streams (W ranks,
  B streams each; rank r owns streams r*B .. r*B+B-1). Each step takes the next bptt
  tokens of every stream; the hidden state is carried from window to window. At the
  end of an epoch every stream starts over and the state is reset. One process with
  batch W*B sees exactly the union of what W ranks with batch B see.
- `ShuffledChunks` (`--state reset`, the paper's protocol): non-overlapping chunks of
  bptt+1 tokens from a random offset each epoch, shuffled, the state reset every batch.
  The permutation is a pure function of (seed, epoch), so the state is two integers.

Either reads its windows from the memory-mapped split (numpy fancy indexing, then a copy
to the device), or, after `make_resident(device)`, from a copy of the whole split on the
device, where each window is one gather and nothing crosses to the device per step. Both
give the same batches and the same state, so a run resumes exactly on either path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from zlm.errors import DataError


@dataclass
class Batch:
    inputs: torch.Tensor  # (T, B) int64
    targets: torch.Tensor  # (T, B) int64
    reset: bool  # the hidden state must start from zero for this batch


def read_window(tokens, starts, offset: int, length: int) -> torch.Tensor:
    """Tokens offset .. offset+length (inclusive) of every stream starting at `starts` (B,):
    (length + 1, B) int64, inputs [:-1] and targets [1:]. Reads only those tokens, so a
    memory-mapped split is never loaded whole (training and evaluation both read this way).
    tokens/starts: numpy arrays, or tensors on one device (a resident split)."""
    if isinstance(tokens, torch.Tensor):
        steps = torch.arange(length + 1, device=tokens.device)[:, None]
        return tokens[starts[None, :] + offset + steps].long()  # (T+1, B) on tokens' device
    idx = starts[None, :] + offset + np.arange(length + 1)[:, None]  # (T+1, B)
    return torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))


def resident_copy(tokens: np.ndarray, device: torch.device) -> torch.Tensor:
    """The whole split on `device`: uint8 ids as they are, wider ones as int32 (N,)."""
    dtype = np.uint8 if tokens.dtype == np.uint8 else np.int32
    return torch.from_numpy(np.ascontiguousarray(tokens, dtype=dtype)).to(device)


def _check_size(n_tokens: int, need: int, what: str) -> None:
    if n_tokens < need:
        raise DataError(
            f"the training split has {n_tokens:,} tokens, too few for {what} "
            f"(needs at least {need:,}); use a smaller --batch-size or --bptt, or more text"
        )


class CarryStreams:
    """B contiguous streams per rank, windows of bptt tokens, state carried."""

    def __init__(self, tokens: np.ndarray, batch: int, bptt: int, rank: int = 0, world: int = 1):
        self.tokens, self.batch, self.bptt = tokens, batch, bptt
        total = batch * world
        _check_size(len(tokens), total * (bptt + 1), f"{total} streams of bptt {bptt}")
        self.stream_len = len(tokens) // total  # tokens per stream, inputs and targets
        first = np.arange(rank * batch, (rank + 1) * batch, dtype=np.int64)
        self.starts = first * self.stream_len  # (B,) offset of each stream in the split
        self.pos = 0  # offset within every stream of the next window
        self.epoch = 0
        self._source, self._starts = tokens, self.starts  # where windows are read from

    def make_resident(self, device: torch.device) -> None:
        """Read every later window from a copy of the split on `device`."""
        self._source = resident_copy(self.tokens, device)
        self._starts = torch.from_numpy(self.starts).to(device)

    @property
    def windows_per_epoch(self) -> int:
        return -(-(self.stream_len - 1) // self.bptt)

    @property
    def progress(self) -> float:
        """Epochs done, fractional."""
        return self.epoch + self.pos / (self.stream_len - 1)

    def next(self) -> Batch:
        reset = self.pos == 0
        T = min(self.bptt, self.stream_len - 1 - self.pos)
        window = read_window(self._source, self._starts, self.pos, T)  # (T+1, B)
        batch = Batch(window[:-1], window[1:], reset)
        self.pos += T
        if self.pos >= self.stream_len - 1:
            self.pos, self.epoch = 0, self.epoch + 1
        return batch

    def state_dict(self) -> dict:
        return {"kind": "carry", "pos": self.pos, "epoch": self.epoch, "starts": self.starts.tolist()}

    def load_state_dict(self, state: dict) -> None:
        self.pos, self.epoch = int(state["pos"]), int(state["epoch"])


class ShuffledChunks:
    """Non-overlapping bptt+1 chunks, random offset and order per epoch, state reset."""

    def __init__(self, tokens: np.ndarray, batch: int, bptt: int, seed: int, rank: int = 0, world: int = 1):
        self.tokens, self.batch, self.bptt, self.seed = tokens, batch, bptt, seed
        self.rank, self.world = rank, world
        _check_size(len(tokens), batch * world * (bptt + 1) + bptt, f"batch {batch * world} of bptt {bptt}")
        self.epoch = 0
        self.index = 0  # next global batch within the epoch
        self._source = tokens  # where windows are read from (`make_resident`)
        self._plan()

    def make_resident(self, device: torch.device) -> None:
        """Read every later window from a copy of the split on `device`."""
        self._source = resident_copy(self.tokens, device)
        self._plan()

    def _plan(self) -> None:
        rng = np.random.default_rng([self.seed, self.epoch])
        offset = int(rng.integers(0, self.bptt))
        n_chunks = (len(self.tokens) - offset) // (self.bptt + 1)
        self.chunk_starts = offset + (self.bptt + 1) * rng.permutation(n_chunks)
        self.batches_per_epoch = n_chunks // (self.batch * self.world)
        if isinstance(self._source, torch.Tensor):
            self.chunk_starts = torch.from_numpy(self.chunk_starts).to(self._source.device)

    @property
    def windows_per_epoch(self) -> int:
        return self.batches_per_epoch

    @property
    def progress(self) -> float:
        """Epochs done, fractional."""
        return self.epoch + self.index / max(self.batches_per_epoch, 1)

    def next(self) -> Batch:
        if self.index >= self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
            self._plan()
        g = self.index * self.batch * self.world + self.rank * self.batch
        starts = self.chunk_starts[g : g + self.batch]  # (B,)
        window = read_window(self._source, starts, 0, self.bptt)  # (T+1, B)
        self.index += 1
        return Batch(window[:-1], window[1:], True)

    def state_dict(self) -> dict:
        return {"kind": "reset", "epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._plan()


def make_streams(protocol: str, tokens: np.ndarray, batch: int, bptt: int, seed: int, rank=0, world=1):
    """`--state carry|reset` -> the batch source for one rank."""
    if protocol == "carry":
        return CarryStreams(tokens, batch, bptt, rank, world)
    return ShuffledChunks(tokens, batch, bptt, seed, rank, world)
