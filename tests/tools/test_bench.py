"""`zlm bench` at tiny sizes: every implementation and phase is measured and reported.

Never asserts wall-clock times or ratios, only the structure of what is reported.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from zlm.cli import app
from zlm.core.precision import cpu_bf16_native
from zlm.errors import UsageError
from zlm.tools.bench import IMPLS, BenchConfig, grid_configs, measure, run_bench

TINY = ["--hidden", "8", "--batch-size", "2", "--bptt", "3", "--vocab", "5",
        "--repeats", "2", "--warmup", "1"]  # fmt: skip


def test_measure_rows_cover_every_impl_and_phase():
    cfg = BenchConfig(hidden=8, batch_size=2, bptt=3, vocab=5, repeats=2, warmup=1)
    rows = measure(cfg)
    assert {(r["impl"], r["phase"]) for r in rows} == {(i, p) for i in IMPLS for p in ("train", "infer")}
    for r in rows:
        assert r["chars_per_s"] > 0 and r["ratio_to_lstm"] > 0
        assert (r["hidden"], r["batch_size"], r["bptt"], r["vocab"]) == (8, 2, 3, 5)
    assert all(r["ratio_to_lstm"] == 1.0 for r in rows if r["impl"] == "nn.LSTM")


def test_cli_json_structure():
    result = CliRunner().invoke(app, ["bench", *TINY, "--sample", "--sample-chars", "10", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["device"] == "cpu" and data["threads"] >= 1 and "fused_cell" in data
    phases = {(r["impl"], r["phase"]) for r in data["rows"]}
    assert phases == {(i, p) for i in IMPLS for p in ("train", "infer", "sample")} | {
        ("nn.LSTM", "model"), ("fused", "model")}  # the whole training step: bar and fused
    (model,) = [r for r in data["rows"] if r["phase"] == "model" and r["impl"] == "fused"]
    assert 0 < model["mask_draw_share"] < 1
    for r in data["rows"]:
        assert set(r) >= {"impl", "phase", "hidden", "batch_size", "bptt", "chars_per_s", "ratio_to_lstm"}
    assert all(r["batch_size"] == 1 for r in data["rows"] if r["phase"] == "sample")


def test_cli_plain_table_names_every_impl():
    result = CliRunner().invoke(app, ["bench", *TINY])
    assert result.exit_code == 0, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("fp32 B=2 H=8 T=3")]
    assert len(lines) == 3  # train, infer, model
    assert "mask draw" in result.output
    for impl in IMPLS:
        assert impl in lines[0]


def test_cpu_bf16_rows_next_to_fp32_and_fp16_refused():
    """bf16 on a CPU with native bf16: every impl under plain autocast, in its own rows;
    elsewhere a one-line error (oneDNN's LSTM has no bf16 there). fp16 needs a GPU."""
    result = CliRunner().invoke(app, ["bench", *TINY, "--precision", "fp32,bf16", "--json"])
    if cpu_bf16_native():
        assert result.exit_code == 0, result.output
        rows = json.loads(result.output)["rows"]
        assert {(r["precision"], r["phase"]) for r in rows} == {
            (p, ph) for p in ("fp32", "bf16") for ph in ("train", "infer", "model")}
    else:
        assert result.exit_code == 2 and "no native bf16" in result.output
        assert len(result.output.strip().splitlines()) == 1
    result = CliRunner().invoke(app, ["bench", *TINY, "--precision", "fp16"])
    assert result.exit_code == 2
    assert "fp16 needs a GPU" in result.output
    assert len(result.output.strip().splitlines()) == 1
    with pytest.raises(UsageError, match="unknown precision 'fp8'"):
        BenchConfig(precision="fp8")
    assert BenchConfig(precision="auto").precision in ("fp32", "bf16")  # resolved, never "auto"


def test_render_with_graphed_rows_and_two_precisions(capsys):
    """The CUDA layout (fused+graphs in train and infer only, fp32 and bf16), rendered plain."""
    from zlm.cli.bench import _render

    rows = []
    for prec in ("fp32", "bf16"):
        for phase, impls in (("train", IMPLS + ("fused+graphs",)), ("infer", IMPLS + ("fused+graphs",)),
                             ("sample", IMPLS)):
            for k, impl in enumerate(impls):
                rows.append(dict(hidden=1000, batch_size=1 if phase == "sample" else 128, bptt=100,
                                 vocab=128, precision=prec, phase=phase, impl=impl,
                                 chars_per_s=1000.0 * (k + 1), ratio_to_lstm=1.0 / (k + 1)))
    _render({"device": "cuda", "threads": 16, "torch": "x", "fused_cell": "Triton", "rows": rows}, rich=False)
    out = capsys.readouterr().out.splitlines()
    train = [ln for ln in out if ln.startswith("bf16 B=128 H=1000 T=100 train")]
    assert len(train) == 1 and "fused+graphs x0.25" in train[0] and "fused+graphs 4,000" in train[0]
    sample = [ln for ln in out if ln.startswith("fp32 B=1 H=1000 T=100 sample")]
    assert len(sample) == 1 and "fused+graphs" not in sample[0]


def test_grid_is_the_standard_one():
    sizes = [(c.batch_size, c.hidden, c.bptt) for c in grid_configs(BenchConfig(vocab=7))]
    assert sizes == [(b, h, 100) for b in (32, 128) for h in (256, 512, 1000)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cuda_without_gpu_is_one_line_error():
    with pytest.raises(UsageError, match="--device cuda"):
        run_bench(BenchConfig(device="cuda"))
    result = CliRunner().invoke(app, ["bench", *TINY, "--device", "cuda"])
    assert result.exit_code == 2
    assert "--device cuda" in result.output and "Traceback" not in result.output


def test_bad_option_is_usage_error():
    result = CliRunner().invoke(app, ["bench", "--hidden", "0"])
    assert result.exit_code == 2 and "--hidden" in result.output


def test_ratio_is_taken_within_rounds_so_drift_cancels():
    """The machine slowed 4x during round 3, between nn.LSTM's run and the fused cell's: the
    ratio of the medians would say 4.4, the median of the rounds' ratios says 1.1."""
    from zlm.tools.bench import round_ratio

    bar = [1.0, 1.0, 1.0, 4.0, 4.0]
    fused = [1.1, 1.1, 4.4, 4.4, 4.4]
    assert round_ratio(fused, bar) == pytest.approx(1.1)
    assert round_ratio(bar, bar) == 1.0
