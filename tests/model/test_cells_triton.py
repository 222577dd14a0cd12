"""The Triton fused cell matches the reference cell, forward and gradients (zlm.model.cells.triton).

Every parity case below runs two ways:
- on CUDA, compiled (`test_triton_cuda[...]`, marked gpu; skipped without a device);
- on CPU under the Triton interpreter (`test_triton_interpreter[...]`). `@triton.jit`
  decides at decoration time whether to interpret, and in the full suite other modules may
  have imported triton or the kernels first, so the interpreter cases run once, together,
  in a subprocess started with TRITON_INTERPRET=1 (this file run as a script); each test
  then reports its own case from that run.

Tolerances, on every output (y, h_T, c_T) and every gradient (x, h0, c0, W_ih, W_hh, b):
- fp32: max abs difference <= 1e-5 (assert_close, atol = rtol = 1e-5) against the
  reference in fp32 on the same device; fp64: 1e-12. The same for zero zoneout against
  torch.nn.LSTM. On the larger CUDA case, where gradients sum over T*B = 1024 terms in a
  different order, relative Frobenius error <= 1e-5.
- bf16 inputs, and fp32 inputs under bf16 autocast, against the fp32 reference: relative
  Frobenius error <= 2e-2 (3e-2 on the larger CUDA case); fp16 inputs: <= 5e-3.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import pytest
import torch

from zlm.model.cells.reference import zoneout_lstm_reference
from zlm.model.cells.triton import triton_unavailable_reason, zoneout_lstm_triton

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _problem(T, B, I, H, device, keep_c, keep_h, dtype=torch.float32, seed=0):
    """Inputs, parameters and masks; a keep given as 'mask:z' is drawn as a (T, B, H) mask."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    tensors = [rnd(T, B, I), rnd(B, H), rnd(B, H),
               rnd(4 * H, I, scale=I**-0.5), rnd(4 * H, H, scale=H**-0.5), rnd(4 * H, scale=0.1)]  # fmt: skip

    def keep(k):
        if isinstance(k, str):
            z = float(k.split(":")[1])
            return (torch.rand(T, B, H, generator=g) < z).to(dtype).to(device)
        return k

    return [t.to(device) for t in tensors], keep(keep_c), keep(keep_h)


def _run(cell, tensors, keep_c, keep_h, x_dtype=None, autocast=None):
    """Outputs and gradients of a fixed random linear loss: [y, h_T, c_T, dx, dh0, ... db]."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    x = leaves[0] if x_dtype is None else leaves[0].to(x_dtype)
    device = x.device.type
    with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        y, h, c = cell(x, *leaves[1:], keep_c, keep_h)
    g = torch.Generator().manual_seed(1)
    loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device)).sum()
               for o in (y, h, c))  # fmt: skip
    loss.backward()
    return [y, h, c] + [t.grad for t in leaves]


NAMES = ["y", "h_T", "c_T", "dx", "dh0", "dc0", "dW_ih", "dW_hh", "db"]


def _close(got, want, tol):
    for name, a, b in zip(NAMES[: len(want)], got, want, strict=True):
        assert a is not None and b is not None, name
        torch.testing.assert_close(
            a.to(b.dtype), b, atol=tol, rtol=tol, msg=lambda m, name=name: f"{name}: {m}"
        )


def _rel_close(got, want, tol):
    for name, a, b in zip(NAMES[: len(want)], got, want, strict=True):
        err = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


def _parity(device, shape, keep_c, keep_h, dtype=torch.float32, tol=1e-5, rel=False):
    tensors, kc, kh = _problem(*shape, device, keep_c, keep_h, dtype=dtype)
    got = _run(zoneout_lstm_triton, tensors, kc, kh)
    want = _run(zoneout_lstm_reference, tensors, kc, kh)
    assert got[0].dtype == want[0].dtype == dtype
    (_rel_close if rel else _close)(got, want, tol)


SMALL = (4, 3, 5, 8)  # T, B, I, H


def case_train_masks(device):
    _parity(device, SMALL, "mask:0.5", "mask:0.3")


def case_eval_expectation(device):
    _parity(device, SMALL, 0.5, 0.05)


def case_mask_and_float_odd_hidden(device):
    _parity(device, (5, 2, 3, 12), "mask:0.4", 0.2)  # H = 12: B*H is no power of two


def case_several_programs(device):
    _parity(device, (3, 9, 4, 130), "mask:0.5", "mask:0.05")  # B*H = 1170: 2 blocks, 2nd partial


def case_fp64(device):
    _parity(device, SMALL, "mask:0.5", 0.1, dtype=torch.float64, tol=1e-12)


def case_no_zoneout_is_torch_lstm(device):
    T, B, I, H = SMALL
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(I, H).to(device)
    x = torch.randn(T, B, I, device=device)
    h0, c0 = torch.randn(2, 1, B, H, device=device)
    bias = lstm.bias_ih_l0 + lstm.bias_hh_l0
    tensors = [x, h0[0], c0[0], lstm.weight_ih_l0, lstm.weight_hh_l0, bias]
    got = _run(zoneout_lstm_triton, [t.detach() for t in tensors], 0.0, 0.0)
    xl = x.clone().requires_grad_()
    h0l, c0l = h0.clone().requires_grad_(), c0.clone().requires_grad_()
    y, (h, c) = lstm(xl, (h0l, c0l))
    g = torch.Generator().manual_seed(1)
    loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64).to(device)).sum()
               for o in (y, h[0], c[0]))  # fmt: skip
    loss.backward()
    want = [y, h[0], c[0], xl.grad, h0l.grad[0], c0l.grad[0],
            lstm.weight_ih_l0.grad, lstm.weight_hh_l0.grad, lstm.bias_ih_l0.grad]  # fmt: skip
    _close(got, [w.detach() for w in want], 1e-5)


def case_inference_no_grad(device):
    tensors, kc, kh = _problem(*SMALL, device, "mask:0.5", 0.05)
    with torch.no_grad():
        got = zoneout_lstm_triton(*tensors, kc, kh)
        want = zoneout_lstm_reference(*tensors, kc, kh)
    assert all(t.grad_fn is None for t in got)
    _close(got, want, 1e-5)


def _low_precision(device, shape, lo, tol, autocast=False):
    tensors, kc, kh = _problem(*shape, device, "mask:0.5", "mask:0.05")
    if autocast:
        got = _run(zoneout_lstm_triton, tensors, kc, kh, autocast=lo)
    else:
        got = _run(zoneout_lstm_triton, tensors, kc.to(lo), kh.to(lo), x_dtype=lo)
    assert got[0].dtype == lo and got[1].dtype == torch.float32  # y in cd, state in fp32
    assert all(g.dtype == torch.float32 for g in got[3:])  # fp32 master-weight gradients
    want = _run(zoneout_lstm_reference, tensors, kc, kh)
    _rel_close(got, want, tol)


def case_bf16_inputs(device):
    _low_precision(device, SMALL, torch.bfloat16, 2e-2)


def case_fp16_inputs(device):
    _low_precision(device, SMALL, torch.float16, 5e-3)


def case_bf16_autocast(device):
    _low_precision(device, SMALL, torch.bfloat16, 2e-2, autocast=True)


LARGE = (16, 64, 48, 256)  # B*H = 16384 units: several programs a step


def case_large_fp32(device):
    _parity(device, LARGE, "mask:0.5", "mask:0.05", tol=1e-5, rel=True)


def case_large_bf16(device):
    _low_precision(device, LARGE, torch.bfloat16, 3e-2)


INTERPRETER_CASES = {f.__name__[5:]: f for f in (
    case_train_masks, case_eval_expectation, case_mask_and_float_odd_hidden,
    case_several_programs, case_fp64,
    case_no_zoneout_is_torch_lstm, case_inference_no_grad, case_bf16_inputs, case_fp16_inputs,
    case_bf16_autocast,
)}  # fmt: skip
CUDA_CASES = {**INTERPRETER_CASES, "large_fp32": case_large_fp32, "large_bf16": case_large_bf16}
CUDA_CASES.pop("fp64")  # fp64 is for exactness checks in the interpreter, not a GPU mode


@pytest.fixture(scope="module")
def interpreter_results():
    """Run every interpreter case once in a child process; {case: None or the failure}."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        cmd = [sys.executable, __file__, str(out)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
        if not out.exists():
            pytest.fail(f"interpreter run crashed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


@pytest.mark.parametrize("case", sorted(INTERPRETER_CASES))
def test_triton_interpreter(case, interpreter_results):
    if interpreter_results[case] is not None:
        pytest.fail(interpreter_results[case], pytrace=False)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CUDA_CASES))
def test_triton_cuda(case):
    why = triton_unavailable_reason()
    if why:
        pytest.skip(why)
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # torch.nn.LSTM parity is against full fp32
    try:
        CUDA_CASES[case]("cuda")
    finally:
        torch.backends.cudnn.allow_tf32 = cudnn_tf32


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without CUDA")
def test_triton_unavailable_without_cuda():
    why = triton_unavailable_reason()
    assert why in ("no CUDA device", "triton is not installed (pip install 'zlm[gpu]')")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter allows CPU")
def test_triton_cell_refuses_cpu_tensors():
    tensors, kc, kh = _problem(*SMALL, "cpu", 0.0, 0.0)
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        zoneout_lstm_triton(*tensors, kc, kh)


def test_triton_cell_module_imports_without_importing_triton():
    code = "import sys, zlm.model.cells.triton; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


if __name__ == "__main__":  # the interpreter child process of `interpreter_results`
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    results = {}
    for name, fn in INTERPRETER_CASES.items():
        try:
            fn("cpu")
            results[name] = None
        except Exception:  # noqa: BLE001 - each case's own test reports its failure
            results[name] = traceback.format_exc()
    Path(sys.argv[1]).write_text(json.dumps(results))
