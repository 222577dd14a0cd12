"""zlm.data.streams: carried TBPTT streams and the paper's reset chunks."""

from __future__ import annotations

import numpy as np
import pytest

from zlm.data.streams import CarryStreams, ShuffledChunks, read_window
from zlm.errors import DataError


def test_read_window_is_the_tokens_of_every_stream():
    tokens = np.arange(100, dtype=np.uint16)
    w = read_window(tokens, np.array([0, 50]), 3, 4)  # (5, 2)
    assert w.shape == (5, 2) and w.dtype.is_floating_point is False
    assert w[:, 0].tolist() == [3, 4, 5, 6, 7] and w[:, 1].tolist() == [53, 54, 55, 56, 57]


def test_carry_streams_cover_each_stream_once_per_epoch_with_targets_shifted():
    tokens = np.arange(1000, dtype=np.uint16)
    s = CarryStreams(tokens, batch=4, bptt=7)
    seen = []
    for k in range(s.windows_per_epoch):
        b = s.next()
        assert b.reset == (k == 0)
        assert (b.targets[:-1] == b.inputs[1:]).all()
        seen.append(b.inputs)
    inputs = np.concatenate([x.numpy() for x in seen])  # (stream_len - 1, B)
    assert inputs.shape == (s.stream_len - 1, 4)
    assert (inputs[:, 1] == np.arange(s.stream_len, 2 * s.stream_len - 1)).all()
    assert s.progress == pytest.approx(1.0) and s.next().reset  # a new epoch starts from zero


def test_streams_resume_from_their_state_dict():
    tokens = np.random.default_rng(0).integers(0, 50, 5000).astype(np.uint8)
    for make in (lambda: CarryStreams(tokens, 3, 11), lambda: ShuffledChunks(tokens, 3, 11, seed=5)):
        a, b = make(), make()
        for _ in range(17):
            a.next()
        b.load_state_dict(a.state_dict())
        for _ in range(40):
            x, y = a.next(), b.next()
            assert (x.inputs == y.inputs).all() and x.reset == y.reset


def test_ranks_take_disjoint_streams():
    tokens = np.arange(2000, dtype=np.uint16)
    r0, r1 = CarryStreams(tokens, 2, 5, rank=0, world=2), CarryStreams(tokens, 2, 5, rank=1, world=2)
    assert set(r0.next().inputs[0].tolist()).isdisjoint(r1.next().inputs[0].tolist())


def test_a_split_too_small_for_the_streams_is_one_line():
    with pytest.raises(DataError):
        CarryStreams(np.arange(10, dtype=np.uint8), batch=4, bptt=100)


@pytest.mark.parametrize("protocol", ["carry", "reset"])
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_a_resident_split_gives_the_same_batches_and_resumes_exactly(protocol, dtype):
    """The split copied to the device once (here the CPU standing in for it): every window is
    the memory-mapped path's, across epochs, and a stream resumed from either path's state
    continues identically on the other."""
    import torch

    from zlm.data.streams import make_streams

    tokens = (np.arange(3_000) * 7919 % 251).astype(dtype)
    mapped = make_streams(protocol, tokens, 4, 16, seed=3)
    resident = make_streams(protocol, tokens, 4, 16, seed=3)
    resident.make_resident(torch.device("cpu"))
    for _ in range(2 * mapped.windows_per_epoch + 3):
        a, b = mapped.next(), resident.next()
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets) and a.reset == b.reset
        assert b.inputs.dtype == torch.int64
    assert mapped.state_dict() == resident.state_dict()
    later = make_streams(protocol, tokens, 4, 16, seed=3)
    later.make_resident(torch.device("cpu"))
    later.load_state_dict(mapped.state_dict())
    for _ in range(5):
        assert torch.equal(mapped.next().inputs, later.next().inputs)
