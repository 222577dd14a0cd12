"""`zlm info RUN_OR_CHECKPOINT`: parse options, call `zlm.info.describe`, render.

Reads JSON and the safetensors header only, never the tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from zlm.cli.render import handle_errors, print_pairs, use_rich


@handle_errors
def command(
    run: Annotated[Path, typer.Argument(
        help="A RUN_DIR (its best/, else its latest complete checkpoint) or a checkpoint "
             "directory.", metavar="RUN_OR_CHECKPOINT", show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Model config, parameter count, tokenizer, step, best BPC and files, without loading tensors."""
    from zlm.tools.info import describe

    info = describe(run)
    if as_json:
        typer.echo(json.dumps(info))
        return
    rich = use_rich()
    _render(info, rich)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:,} B" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def _bpc(x) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _sampled(train: dict) -> str:
    """How a run validated: on a sample of the valid split (--eval-tokens), or all of it."""
    n = train.get("eval_tokens") or 0
    return f" (on a {n:,}-token sample of the valid split; zlm eval scores all of it)" if n else ""


def _trained_with(r: dict) -> str:
    """Precision, cell and kernel, and what ran the CPU cell's recurrent products."""
    from zlm.core.spec import PRODUCT_NAMES

    product = PRODUCT_NAMES.get(r.get("product", ""))
    return (f"{r['precision']}, {r['cell']} cell ({r['kernel']} kernel"
            + (f", recurrent products on {product})" if product else ")"))


def _rows(info: dict) -> list[tuple[str, str]]:
    m, tok = info["model"], info["tokenizer"]
    rows = [
        ("checkpoint", info["checkpoint"]),
        ("model", f"{m['layers']} x {m['hidden']} zoneout LSTM, embed {m['embed']}, "
                  f"zoneout c {m['zoneout_cell']} h {m['zoneout_hidden']}, dropout {m['dropout']}"),
        ("parameters", f"{info['parameters']:,} ({', '.join(info['dtypes'])})"),
        ("trained with", _trained_with(info["resolved"])),
        ("tokenizer", f"{tok['kind']}, vocabulary {tok['vocab_size']}"),
        ("step", str(info["step"])),
        ("best valid BPC", _bpc(info["best_valid_bpc"]) + _sampled(info["train"])),
    ]
    if info.get("train_slice_bpc") is not None and info.get("valid_bpc") is not None:
        rows.append(("generalisation gap", f"{info['valid_bpc'] - info['train_slice_bpc']:+.4f} BPC (valid "
                                           f"{info['valid_bpc']:.4f} - a train slice {info['train_slice_bpc']:.4f}, "
                                           "both in eval mode)"))
    if info.get("cool_down"):
        cool = info["cool_down"]
        rows.append(("overfitting", f"seen at step {cool['at']}: back to step {cool['best_step']}'s weights (best/), "
                                    f"lr cooled from {cool['lr']:.3g} to 0 until step {cool['until']}, then stopped"))
    if "run" in info:
        run = info["run"]
        rows.append(("run", f"{run['dir']}: {len(run['checkpoints'])} step checkpoints, "
                            f"latest step {run['latest_step']}"))
    if info["data"]:
        rows.append(("data", info["data"]))
    if info.get("parent"):
        rows.append(("initialised from", f"{info['parent']['path']} (model sha256 "
                                         f"{info['parent']['model_sha256'][:16]})"))
    if info["mismatches"]:
        rows.append(("WARNING", "tensors do not match config.json: " + "; ".join(info["mismatches"][:3])))
    for f in info["files"]:
        rows.append((f"  {f['name']}", _size(f["bytes"])))
    return rows


def _render(info: dict, rich: bool) -> None:
    print_pairs(_rows(info), rich, lambda k, v: f"{k}: {v}" if not k.startswith("  ") else f"{k}  {v}")
