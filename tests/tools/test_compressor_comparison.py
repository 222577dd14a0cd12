"""The compressor comparison (zlm.tools.compressors): rows for zlm and what is installed."""

from __future__ import annotations

import shutil

import torch

from conftest import shakespeare_text
from zlm.core.precision import resolve_runtime
from zlm.data.tokenizers import CharTokenizer
from zlm.inference.dynamic import DynamicConfig
from zlm.inference.load import LoadedModel
from zlm.model.cells import choose_cell
from zlm.model.lm import ModelConfig, ZoneoutLM
from zlm.tools.compressors import compare_loaded, markdown


def test_table_has_every_compressor(tmp_path):
    text = shakespeare_text(3000)
    tok = CharTokenizer(text)
    torch.manual_seed(0)
    model = ZoneoutLM(ModelConfig(vocab_size=tok.vocab_size, hidden=8, embed=4)).eval()
    model.requires_grad_(False)
    tok.save(tmp_path)
    lm = LoadedModel(model, tok, resolve_runtime("cpu", "fp32"), tmp_path, {}, choose_cell("auto", "cpu"))
    f = tmp_path / "t.txt"
    f.write_text(text[:1500], encoding="utf-8")
    rows, notes = compare_loaded(lm, [f], DynamicConfig(1e-3, 1e-3, 16))
    names = [r.compressor for r in rows]
    assert names[:2] == ["zlm", "zlm --adapt"]
    for tool in ("gzip", "bzip2", "xz", "zstd"):
        assert any(n.startswith(tool) for n in names) == (shutil.which(tool) is not None)
        assert any(tool in n for n in notes) == (shutil.which(tool) is None)
    assert rows[0].model_bytes == 4 * model.num_parameters()
    table = markdown(rows, notes)
    assert "| t.txt | zlm |" in table and "bits/byte" in table
