"""The compiled fused CPU cell (C++ step) matches the reference cell: fp32, fp64, bf16.

Tolerances: 1e-5 absolute in fp32, 1e-10 in fp64 (as the Python fused cell), gradcheck in
fp64; under bf16 autocast (bf16 matrix multiplies, fp32 state) 2e-2 relative in norm on
every output and gradient against the fp32 reference. Every test runs with both sets of
backends of the recurrent product: the vendors' micro-kernels (fp32: MKL's packed GEMM where
torch carries MKL; bf16: oneDNN's AMX micro-kernel where the CPU has AMX) and oneDNN's
packed linear. The extension builds once per machine into the shared cache
(`zlm.model.cells.cpu_ext.cache_root`); where a compiler exists a failed build fails these
tests instead of skipping them.
"""

from __future__ import annotations

import pytest
import torch
from cell_cases import NAMES, cell_inputs, cell_outputs

from zlm.model.cells import choose_cell, compiled, cpu_ext, packed_gemm
from zlm.model.cells.compiled import make_compiled_cell
from zlm.model.cells.packed_gemm import clear_cache
from zlm.model.cells.reference import zoneout_lstm_reference
from zlm.model.cells.workspace import clear_workspaces
from zlm.model.lm import ModelConfig, ZoneoutLM

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
BF16_REL = 2e-2
@pytest.fixture(scope="module")
def cell():
    ext = cpu_ext.load_extension()
    if ext is None:
        why = cpu_ext.unavailable_reason()
        if cpu_ext._compiler_missing() or "ZLM_NO_EXTENSION" in (why or ""):
            pytest.skip(f"no compiled step here: {why}")
        pytest.fail(f"a compiler exists but the C++ step did not build: {why}")
    return make_compiled_cell(ext)


@pytest.fixture(autouse=True)
def _fresh_caches():
    clear_cache()
    clear_workspaces()
    yield


@pytest.fixture(autouse=True, params=["mkl+amx", "onednn", "mkl+amx, views", "onednn, views"])
def recurrent(request, monkeypatch):
    """The windows' recurrent product: MKL's packed GEMM (fp32) and AMX's micro-kernel (bf16),
    where they exist, or oneDNN's packed linear for both; and the fp32 weight gradients from
    the C++ backward's transposed copies (`transposed_grads`, the AVX-512 path) or, ", views",
    torch.mm on the window's buffers (the AVX2 path), whichever this CPU would take."""
    ext = cpu_ext.load_extension()
    product = request.param.split(",")[0]
    if product == "mkl+amx" and (ext is None or not (ext.mkl_packed_ready() or ext.amx_ready())):
        pytest.skip("neither MKL's packed GEMM nor AMX here")
    monkeypatch.setattr(compiled, "USE_MKL", product == "mkl+amx")
    monkeypatch.setattr(compiled, "USE_AMX", product == "mkl+amx")
    monkeypatch.setattr(compiled, "on_intel", lambda: True)  # MKL's path runs on any x86 here
    monkeypatch.setattr(compiled, "TRANSPOSED_GRADS", not request.param.endswith("views"))
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("masks", ["train", "eval", "off"])
@pytest.mark.parametrize("shape", [(7, 3, 5, 6), (1, 2, 4, 3), (12, 8, 16, 32)])
def test_matches_reference(cell, dtype, masks, shape):
    args, keeps = cell_inputs(*shape, dtype, masks)
    want = cell_outputs(zoneout_lstm_reference, args, keeps)
    got = cell_outputs(cell, args, keeps)
    for name, a, b in zip(NAMES, got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL[dtype], msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_split_over_threads_match_reference(cell, dtype):
    """B*H above the kernel's grain (8K elements): rows run in parallel chunks. fp32 sums
    over 4000 gates here, so its bound is 5e-5 (the Python fused cell is as far off)."""
    args, keeps = cell_inputs(3, 40, 8, 1000, dtype, "train")
    want = cell_outputs(zoneout_lstm_reference, args, keeps)
    got = cell_outputs(cell, args, keeps)
    atol = 5e-5 if dtype == torch.float32 else TOL[dtype]
    for name, a, b in zip(NAMES, got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("masks", ["train", "eval"])
def test_gradcheck_float64(cell, masks):
    args, keeps = cell_inputs(3, 2, 3, 2, torch.float64, masks, seed=3)
    assert torch.autograd.gradcheck(lambda *a: cell(*a, *keeps), args)


@pytest.mark.cpu_feature("bf16")
@pytest.mark.parametrize("masks", ["train", "eval", "off"])
@pytest.mark.parametrize("onednn", [True, False])
def test_bf16_autocast_within_2e2_of_fp32_reference(cell, masks, onednn, monkeypatch):
    """bf16 multiplies, fp32 state: outputs and gradients fp32, within 2e-2 relative - with
    packed bf16 oneDNN weights (CPUs with native bf16) and with torch.mm (the others)."""
    if onednn and not packed_gemm.ONEDNN_BF16:
        pytest.skip("this CPU has no native bf16: oneDNN packs no bf16 weights")
    monkeypatch.setattr(packed_gemm, "ONEDNN_BF16", onednn)
    args, keeps = cell_inputs(20, 8, 16, 64, torch.float32, masks)
    want = cell_outputs(zoneout_lstm_reference, args, keeps)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = cell_outputs(cell, args, keeps)
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert a.dtype == torch.float32, name
        rel = ((a - b).norm() / b.norm()).item()
        assert rel < BF16_REL, f"{name}: {rel:.3g}"


def test_no_grad_windows_and_single_steps(cell):
    """The inference path (nothing saved), T=1 calls with the state carried, and a weight
    update in between (an optimizer step must not hit a stale packed weight)."""
    args, _ = cell_inputs(1, 1, 8, 16, torch.float32, "eval")
    x, h, c, w_ih, w_hh, b = (a.detach() for a in args)
    hr, cr = h, c
    with torch.no_grad():
        for k in range(4):
            if k == 2:
                w_hh.mul_(0.5)
            y, h, c = cell(x, h, c, w_ih, w_hh, b, 0.5, 0.05)
            yr, hr, cr = zoneout_lstm_reference(x, hr, cr, w_ih, w_hh, b, 0.5, 0.05)
            torch.testing.assert_close(y, yr, rtol=0, atol=1e-5)
            torch.testing.assert_close(c, cr, rtol=0, atol=1e-5)


def test_outputs_survive_later_windows_and_retained_graphs(cell):
    args, keeps = cell_inputs(4, 2, 3, 5, torch.float64, "train")
    y, h, c = cell(*args, *keeps)
    saved = [t.detach().clone() for t in (y, h, c)]
    loss = y.sum() + c.sum()
    g1 = torch.autograd.grad(loss, args, retain_graph=True)
    args2, _ = cell_inputs(4, 2, 3, 5, torch.float64, "train", seed=9)
    cell(*(a.detach() for a in args2), *keeps)  # another window in between
    g2 = torch.autograd.grad(loss, args)
    for a, b in zip((y, h, c), saved, strict=True):
        assert torch.equal(a.detach(), b)
    for a, b in zip(g1, g2, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("training", [True, False])
def test_model_two_windows_matches_reference(cell, training):
    """Same seed -> same masks (drawn outside the cell); state carried over two windows."""
    config = ModelConfig(vocab_size=11, hidden=12, layers=2, embed=7)
    torch.manual_seed(0)
    ref = ZoneoutLM(config)
    fast = ZoneoutLM(config, cell=cell)
    fast.load_state_dict(ref.state_dict())
    assert list(fast.state_dict()) == list(ref.state_dict())
    tokens = torch.randint(11, (2, 6, 3), generator=torch.Generator().manual_seed(5))
    results = []
    for model in (ref, fast):
        model.train(training)
        state, losses = None, []
        for k in range(2):
            torch.manual_seed(100 + k)
            logits, state = model(tokens[k], state)
            loss = logits.square().mean()
            loss.backward()
            state, losses = tuple(s.detach() for s in state), losses + [loss.detach()]
        results.append((losses, state, [p.grad for p in model.parameters()]))
    (l1, s1, g1), (l2, s2, g2) = results
    torch.testing.assert_close(l2, l1, rtol=0, atol=1e-5)
    torch.testing.assert_close(s2, s1, rtol=0, atol=1e-5)
    for a, b in zip(g2, g1, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_chooser_picks_the_compiled_step(cell):
    choice = choose_cell("auto", "cpu")
    assert choice.name == "fused"
    assert "compiled C++ step" in choice.reason
    assert choice.fn is choose_cell("fused", "cpu").fn  # one function object per module


@pytest.mark.cpu_feature("bf16")
@pytest.mark.parametrize("masks", ["train", "eval"])
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("bf16", [False, True])
def test_time_loop_in_cpp_equals_the_python_loop(masks, grad, bf16):
    """forward_window and backward_window (the time loops in C++, fp32 or bf16 multiplies)
    run the same products (MKL's, AMX's or oneDNN's) and the same element-wise steps as the Python loops:
    identical outputs and state gradients. In fp32 the C++ loop may also write dpre and h_prev
    transposed for oneDNN weight-gradient products (`transposed_grads`; the Python loop uses
    torch.mm): dx and the weight gradients agree to 1e-5 there; db, summed step by step in
    C++ where it is (the Python loop: one torch.sum), agrees to 1e-5 in both precisions."""
    import contextlib
    import types

    ext = cpu_ext.load_extension()
    if ext is None or not hasattr(ext, "forward_window"):
        pytest.skip("no compiled step here")
    if bf16 and not packed_gemm.ONEDNN_BF16:
        pytest.skip("this CPU has no native bf16: the bf16 loop stays in Python")
    python_loop = make_compiled_cell(types.SimpleNamespace(
        forward_step=ext.forward_step, backward_step=ext.backward_step, mkl_packed_ready=ext.mkl_packed_ready,
        mkl_pack=ext.mkl_pack, mkl_packed_mm=ext.mkl_packed_mm, amx_ready=ext.amx_ready, amx_pack=ext.amx_pack,
        amx_mm=ext.amx_mm))
    args, keeps = cell_inputs(9, 4, 6, 16, torch.float32, masks)
    precision = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with precision:
        if grad:
            got, want = cell_outputs(make_compiled_cell(ext), args, keeps), cell_outputs(python_loop, args, keeps)
        else:
            with torch.no_grad():
                plain = [a.detach() for a in args]
                got, want = make_compiled_cell(ext)(*plain, *keeps), python_loop(*plain, *keeps)
    for name, a, b in zip(NAMES, got, want, strict=False):
        if name in ("dx", "dW_ih", "dW_hh", "db") and (name == "db" or not bf16):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(a, b), name


@pytest.mark.cpu_feature("bf16")
@pytest.mark.parametrize("bf16", [False, True])
def test_window_large_enough_for_the_packed_input_projection(cell, bf16, monkeypatch):
    """T*B >= 2048 rows: the input projection runs as one packed oneDNN product (smaller
    windows use addmm); both agree with the reference (1e-5 fp32, 2e-2 relative in bf16).
    The weight and bias gradients sum 2048 rows here (|db| ~ 76): 1e-5 relative for them."""
    if not packed_gemm.ONEDNN or (bf16 and not packed_gemm.ONEDNN_BF16):
        pytest.skip("no oneDNN (bf16) here: the projection is addmm")
    tags = []
    real = compiled.recurrent_gemm
    monkeypatch.setattr(compiled, "recurrent_gemm", lambda *a, **k: tags.append(a[2]) or real(*a, **k))
    args, keeps = cell_inputs(64, 32, 8, 16, torch.float32, "train")
    want = cell_outputs(zoneout_lstm_reference, args, keeps)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        got = cell_outputs(cell, args, keeps)
    assert ("x16" if bf16 else "x") in tags
    for name, a, b in zip(NAMES, got, want, strict=True):
        if bf16:
            rel = ((a - b).norm() / b.norm()).item()
            assert rel < BF16_REL, f"{name}: {rel:.3g}"
        else:
            rtol = 1e-5 if name in ("dW_ih", "dW_hh", "db") else 0.0
            torch.testing.assert_close(a, b, rtol=rtol, atol=TOL[torch.float32], msg=name)


def test_bf16_pair_rounds_as_torch_and_transposes():
    """The C++ conversion of W_hh for bf16 windows: the same bits as torch's .to(bf16)
    (round to nearest even; NaN stays NaN), and its transpose, for odd shapes too."""
    ext = cpu_ext.load_extension()
    if ext is None or not hasattr(ext, "bf16_pair"):
        pytest.skip("no compiled step here")
    g = torch.Generator().manual_seed(0)
    for n, k in ((2048, 512), (37, 45), (1, 1)):
        w = torch.randn(n, k, generator=g) * 10.0 ** torch.randint(-30, 30, (n, k), generator=g)
        w.view(-1)[:4] = torch.tensor([float("inf"), -float("inf"), 3.4e38, -0.0])[: w.numel()]
        w.view(-1)[-1] = 1.0 + 2.0**-8  # a tie: rounds to even (1.0)
        if w.numel() > 5:
            w.view(-1)[4] = float("nan")
        out, out_t = torch.empty(n, k, dtype=torch.bfloat16), torch.empty(k, n, dtype=torch.bfloat16)
        ext.bf16_pair(w, out, out_t)
        want = w.to(torch.bfloat16)
        nan = w.isnan()
        assert torch.equal(out.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
        assert out[nan].isnan().all()
        assert torch.equal(out_t.view(torch.int16), out.t().contiguous().view(torch.int16))


def test_the_weight_gradients_take_the_chosen_path(recurrent):
    """fp32: with `transposed_grads` the C++ backward fills the transposed copies and sums db
    step by step; without, the workspace never allocates them and db is one sum of dpre."""
    ext = cpu_ext.load_extension()
    if ext is None or not hasattr(ext, "backward_window") or compiled.recurrent_backend(ext) == "addmm":
        pytest.skip("no compiled time loop here")
    from zlm.model.cells.workspace import take_workspace

    args, keeps = cell_inputs(5, 4, 6, 16, torch.float32, "train")
    cell_outputs(make_compiled_cell(ext), args, keeps)
    ws = take_workspace(compiled.StepWorkspace, 5, 4, 16, torch.float32, torch.device("cpu"))
    if compiled.transposed_grads():
        assert ws.transposed and ws.dgates_t is not None and ws.h_t is not None and ws.db is not None
        assert torch.equal(ws.dgates_t, ws.dgates.view(5 * 4, -1).t())
    else:
        assert not ws.transposed and ws.dgates_t is None and ws.h_t is None and ws.db is None


def test_the_windows_take_the_chosen_recurrent_product(recurrent, monkeypatch):
    """fp32 windows run the backend `recurrent_backend` names (MKL's packed GEMM on an Intel
    CPU whose torch has it, else oneDNN's), forward and backward; MKL's product (mkl_gemm.cpp):
    c = a W^T + beta c for odd shapes within 1e-5 of torch.mm, through the extension and
    through RecurrentGemm."""
    ext = cpu_ext.load_extension()
    other = "onednn" if packed_gemm.ONEDNN else "addmm"
    want = "mkl" if recurrent.startswith("mkl+amx") and ext.mkl_packed_ready() else other
    assert compiled.recurrent_backend(ext) == want
    backends = []
    real = compiled.recurrent_gemm
    monkeypatch.setattr(compiled, "recurrent_gemm", lambda *a, **k: backends.append(k.get("backend")) or real(*a, **k))
    args, keeps = cell_inputs(5, 4, 6, 16, torch.float32, "train")
    cell_outputs(make_compiled_cell(ext), args, keeps)
    assert backends == [want, want]  # the forward's product and the backward's
    if want != "mkl":
        return
    g = torch.Generator().manual_seed(0)
    for m, n, k in ((32, 2048, 512), (3, 7, 5), (1, 4, 1)):
        a, w, c = (torch.randn(*s, generator=g) for s in ((m, k), (n, k), (m, n)))
        packed = ext.mkl_pack(w, m)
        assert packed.dtype == torch.uint8
        out = c.clone()
        ext.mkl_packed_mm(a, packed, 1.0, out)
        torch.testing.assert_close(out, c + a @ w.t(), rtol=1e-5, atol=1e-5)
        ext.mkl_packed_mm(a, packed, 0.0, out)
        torch.testing.assert_close(out, a @ w.t(), rtol=1e-5, atol=1e-5)
        bias = torch.randn(n, generator=g)
        gemm = packed_gemm.RecurrentGemm(w, m, bias, backend="mkl", ext=ext)
        torch.testing.assert_close(gemm.mm(a), a @ w.t() + bias, rtol=1e-5, atol=1e-5)
        other_t = torch.randn(m, n, generator=g)
        before = other_t.clone()
        got = gemm.add(a, other_t, torch.empty(m, n))
        torch.testing.assert_close(got, other_t + a @ w.t(), rtol=1e-5, atol=1e-5)
        assert torch.equal(other_t, before)
    with pytest.raises(RuntimeError, match="fp32"):
        ext.mkl_pack(torch.ones(3, 4, dtype=torch.float64), 2)
    monkeypatch.setattr(compiled, "on_intel", lambda: False)  # another vendor: MKL for small models only
    assert compiled.recurrent_backend(ext) == other  # the size not known
    assert compiled.recurrent_backend(ext, hidden=compiled.MKL_ELSEWHERE_MAX_HIDDEN) == "mkl"
    assert compiled.recurrent_backend(ext, hidden=compiled.MKL_ELSEWHERE_MAX_HIDDEN + 1) == other
    backends.clear()
    monkeypatch.setattr(compiled, "MKL_ELSEWHERE_MAX_HIDDEN", 15)  # the H 16 windows above are past it
    cell_outputs(make_compiled_cell(ext), args, keeps)
    assert backends == [other, other]


@pytest.mark.cpu_feature("bf16")
@pytest.mark.parametrize("hidden", [16, 64, 10, 24, 1000, 7, 1040])
def test_bf16_windows_take_amx_up_to_its_size(recurrent, hidden, monkeypatch):
    """bf16 windows run AMX's micro-kernel where the CPU has it, for an even H up to
    AMX_MAX_HIDDEN (else oneDNN's packed linear), forward and backward, and stay within 2e-2
    of the fp32 reference - also where the products' columns are padded to a multiple of 16
    (H 10: both products; 24 and 1000: the backward's)."""
    ext = cpu_ext.load_extension()
    if not packed_gemm.ONEDNN_BF16:
        pytest.skip("this CPU has no native bf16: the bf16 loop stays in Python")
    assert compiled.AMX_MAX_HIDDEN < 1040
    amx = recurrent.startswith("mkl+amx") and ext.amx_ready() and hidden % 2 == 0 and hidden <= compiled.AMX_MAX_HIDDEN
    want = "amx" if amx else "onednn"
    assert compiled.recurrent_backend(ext, torch.bfloat16, hidden) == want
    backends = []
    real = compiled.recurrent_gemm
    monkeypatch.setattr(compiled, "recurrent_gemm", lambda *a, **k: backends.append(k.get("backend")) or real(*a, **k))
    args, keeps = cell_inputs(4, 3, 8, hidden, torch.float32, "train")
    want_out = cell_outputs(zoneout_lstm_reference, args, keeps)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = cell_outputs(make_compiled_cell(ext), args, keeps)
    assert backends == [want, want]  # the forward's product and the backward's
    for name, a, b in zip(NAMES, got, want_out, strict=True):
        rel = ((a - b).norm() / b.norm()).item()
        assert rel < BF16_REL, f"{name}: {rel:.3g}"


@pytest.mark.cpu_feature("amx")
def test_amx_product_matches_torch():
    """AMX's product (amx_gemm.cpp): a (M, K) bf16 x B (K, N) bf16 -> fp32, against the same
    product in fp32 (1e-5 relative: both sum exact bf16 products in fp32), for batch sizes
    from 1 to 256, blocks of 32 or 16 columns and N padded to a multiple of 16 (the padding's
    columns come out 0); through RecurrentGemm (mm with a bias, add: N columns); a B it cannot
    pack is refused in one line."""
    ext = cpu_ext.load_extension()
    if not ext.amx_ready():
        pytest.skip("no AMX here")
    g = torch.Generator().manual_seed(0)
    for m, k, n in ((32, 128, 512), (32, 512, 128), (1, 64, 16), (7, 16, 48), (256, 96, 384), (5, 40, 10),
                    (3, 4000, 1000), (2, 2, 1)):
        a, b = torch.randn(m, k, generator=g).bfloat16(), torch.randn(k, n, generator=g).bfloat16()
        packed = ext.amx_pack(b)
        padded = -(-n // 16) * 16
        block = 32 if padded % 32 == 0 else 16
        assert packed.dtype == torch.bfloat16 and packed.shape == (padded // block, k, block)
        full, want = ext.amx_mm(a, packed), a.float() @ b.float()
        assert full.dtype == torch.float32 and full.shape == (m, padded)
        assert torch.equal(full[:, n:], torch.zeros(m, padded - n))
        got = full[:, :n]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        bias = torch.randn(n, generator=g)
        gemm = packed_gemm.RecurrentGemm(b.t(), m, bias, backend="amx", ext=ext)  # W = B^T, as a view
        torch.testing.assert_close(gemm.mm(a), want + bias, rtol=1e-5, atol=1e-4 * want.abs().max().item())
        other = torch.randn(m, n, generator=g)
        before = other.clone()
        torch.testing.assert_close(gemm.add(a, other, torch.empty(m, n)), other + want, rtol=1e-5,
                                   atol=1e-4 * want.abs().max().item())
        assert torch.equal(other, before)
    with pytest.raises(RuntimeError, match="bf16"):
        ext.amx_pack(torch.ones(4, 32))
    with pytest.raises(RuntimeError, match="K even"):
        ext.amx_pack(torch.ones(5, 32, dtype=torch.bfloat16))
