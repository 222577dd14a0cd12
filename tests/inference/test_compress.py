"""zlm compress: exact round trips for any bytes, near-ideal size, refused bad inputs."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import shakespeare_text
from zlm.core.precision import resolve_runtime
from zlm.data.tokenizers import CharTokenizer, train_tokenizer
from zlm.inference.compress import CompressedFileError, Header, compress_bytes, decompress_bytes
from zlm.inference.dynamic import DynamicConfig
from zlm.inference.load import LoadedModel
from zlm.inference.modelcoder import fixed_threads
from zlm.inference.symbols import Alphabet
from zlm.model.cells import choose_cell
from zlm.model.lm import ModelConfig, ZoneoutLM

ADAPT = DynamicConfig(1e-3, 1e-3, 8)
SLOW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def make_lm(tokenizer, path, seed=0, sharpen=1.0) -> LoadedModel:
    """An untrained model (fine for round trips); sharpen scales the decoder (peaked p)."""
    torch.manual_seed(seed)
    model = ZoneoutLM(ModelConfig(vocab_size=tokenizer.vocab_size, hidden=16, embed=8))
    with torch.no_grad():
        model.decoder.weight.mul_(sharpen)
    model.eval().requires_grad_(False)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(path)
    return LoadedModel(model, tokenizer, resolve_runtime("cpu", "fp32"), path, {},
                       choose_cell("auto", "cpu"))


@pytest.fixture(scope="module")
def lms(tmp_path_factory):
    root = tmp_path_factory.mktemp("lms")
    text = shakespeare_text(5000)
    with fixed_threads():
        return {"char": make_lm(CharTokenizer(text), root / "char"),
                "byte": make_lm(train_tokenizer("byte"), root / "byte"),
                "bpe": make_lm(train_tokenizer("bpe", text, vocab_size=400), root / "bpe")}


def roundtrip(lm, data: bytes, adapt=None, streams=None) -> bytes:
    blob, result = compress_bytes(lm, data, adapt, streams)
    back, _ = decompress_bytes(lm, blob)
    assert back == data
    return blob


@SLOW
@given(text=st.text(max_size=80), kind=st.sampled_from(["char", "byte", "bpe"]),
       adapt=st.booleans(), streams=st.sampled_from([None, 1, 3]))
def test_roundtrip_any_unicode(lms, text, kind, adapt, streams):
    roundtrip(lms[kind], text.encode("utf-8", "surrogatepass"), ADAPT if adapt else None, streams)


@SLOW
@given(data=st.binary(max_size=80), kind=st.sampled_from(["char", "byte", "bpe"]),
       adapt=st.booleans())
def test_roundtrip_any_bytes(lms, data, kind, adapt):
    roundtrip(lms[kind], data, ADAPT if adapt else None, 2)


@pytest.mark.parametrize("data", [b"", b"a", b"\n", b"\xff", "\u20ac".encode()])
@pytest.mark.parametrize("adapt", [None, ADAPT])
def test_roundtrip_edges(lms, data, adapt):
    for kind in ("char", "byte", "bpe"):
        roundtrip(lms[kind], data, adapt)


@given(data=st.binary(max_size=60) | st.text(max_size=60).map(lambda t: t.encode("utf-8", "surrogatepass")),
       kind=st.sampled_from(["char", "byte", "bpe"]))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_alphabet_roundtrip(lms, data, kind):
    alpha = Alphabet(lms[kind].tokenizer)
    sym, esc = alpha.encode(data)
    assert ((0 <= sym) & (sym < alpha.size)).all()
    assert alpha.decode(sym, esc) == data


@pytest.mark.parametrize("sharpen", [1.0, 30.0])
def test_size_within_half_a_percent_of_the_model_code_length(tmp_path, sharpen):
    text = shakespeare_text(30_000)
    lm = make_lm(CharTokenizer(text), tmp_path, seed=1, sharpen=sharpen)
    data = text[24_000:].encode()  # 6000 characters
    for adapt in (None, ADAPT):
        blob, r = compress_bytes(lm, data, adapt, streams=4)
        payload = r.compressed_bytes - r.header_bytes
        assert payload <= r.model_bits / 8 * 1.005 + 5, (payload, r.model_bits / 8)
        assert decompress_bytes(lm, blob)[0] == data


def test_adapt_is_deterministic_and_differs_from_static(lms):
    data = shakespeare_text(1000).encode()
    a = roundtrip(lms["char"], data, ADAPT)
    assert a == compress_bytes(lms["char"], data, ADAPT)[0]
    assert a != compress_bytes(lms["char"], data)[0]


def test_refuses_damage_truncation_and_another_model(lms, tmp_path):
    lm = lms["char"]
    data = shakespeare_text(2000).encode()
    blob, _ = compress_bytes(lm, data)
    _, pos = Header.unpack(blob, "f")
    cases = {
        "truncated": blob[: pos + (len(blob) - pos) // 2],
        "truncated (its header": blob[:20],
        "header fails its CRC": blob[:30] + bytes((blob[30] ^ 1,)) + blob[31:],
        "fails its checksum": blob[: pos + 40] + bytes((blob[pos + 40] ^ 0x10,)) + blob[pos + 41 :],
        "not a zlm compressed file": b"PK\x03\x04" + blob[4:],
        "format version 9": blob[:4] + b"\x09" + blob[5:],
    }
    for expect, bad in cases.items():
        with pytest.raises(CompressedFileError, match=re.escape(expect)):
            decompress_bytes(lm, bad, "f")
    other = make_lm(lm.tokenizer, tmp_path / "other", seed=5)
    with pytest.raises(CompressedFileError, match="different model"):
        decompress_bytes(other, blob, "f")
