"""The "mix16" zoneout mask draw: splitmix64 against a Python reference, and the C++ pass
and the torch expression give the same bits."""

from __future__ import annotations

import pytest
import torch

from zlm.model.cells import cpu_ext
from zlm.model.cells.masks import draw_keep, mix_words


@pytest.fixture(scope="module")
def ext():
    module = cpu_ext.load_extension()
    if module is None or not hasattr(module, "draw_mask"):
        pytest.skip(f"no compiled extension here: {cpu_ext.unavailable_reason()}")
    return module


def test_splitmix64_words_match_the_reference_sequence():
    """splitmix64 (Steele et al.), state 0 advanced by GAMMA per call, in Python integers."""
    def reference(state: int, n: int) -> list[int]:
        out, m = [], (1 << 64) - 1
        for _ in range(n):
            state = (state + 0x9E3779B97F4A7C15) & m
            z = state
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
            out.append(z ^ (z >> 31))
        return out

    for seed in (0, 12345, -(2**63), 2**63 - 1):
        got = mix_words(torch.tensor([seed]), 9)
        assert [int(v) & ((1 << 64) - 1) for v in got] == reference(seed & ((1 << 64) - 1), 9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(100, 32, 512), (3, 5, 7), (1, 1, 1), (2, 3, 2), (7, 1, 1)])
@pytest.mark.parametrize("z", [0.5, 0.05, 0.999, 1e-6])
def test_cpp_pass_equals_the_torch_expression(ext, monkeypatch, dtype, shape, z):
    fast = draw_keep(z, shape, True, dtype=dtype, device="cpu", generator=torch.Generator().manual_seed(7))
    monkeypatch.setattr(cpu_ext, "loaded", lambda: None)  # no extension: the torch expression
    slow = draw_keep(z, shape, True, dtype=dtype, device="cpu", generator=torch.Generator().manual_seed(7))
    assert fast.dtype == slow.dtype == dtype and torch.equal(fast, slow)


def test_mix16_takes_one_seed_from_the_generator():
    """The generator's state decides the mask; one int64 is consumed per mask."""
    g = torch.Generator().manual_seed(11)
    a = draw_keep(0.5, (4, 3, 8), True, dtype=torch.float32, device="cpu", generator=g)
    after = g.get_state()
    g2 = torch.Generator().manual_seed(11)
    seed = torch.empty(1, dtype=torch.int64).random_(-(2**63), None, generator=g2)
    assert torch.equal(g2.get_state(), after)
    r16 = mix_words(seed, 24).view(torch.int16)[:96].view(4, 3, 8)
    assert torch.equal(a, (r16 < round(0.5 * 65536) - 32768).float())
