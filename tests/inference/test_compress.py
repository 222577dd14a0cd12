"""zlm compress: exact round trips for any bytes, near-ideal size, never larger than the
input and its header, long repeats nearly free, refused bad inputs."""

from __future__ import annotations

import random
import re
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import shakespeare_text
from zlm.core.precision import resolve_runtime
from zlm.data.tokenizers import CharTokenizer, train_tokenizer
from zlm.inference import modelcoder
from zlm.inference.compress import CompressedFileError, Header, compress_bytes, decompress_bytes
from zlm.inference.dynamic import DynamicConfig
from zlm.inference.load import LoadedModel
from zlm.inference.modelcoder import Layout, fixed_threads
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


LINE = "Crème brûlée — 東京の天気は雨 🌧 naïve\n".encode()  # 54 bytes, most escaped in a char model


def stored_size(data: bytes, blocks: int) -> int:
    """The container of `data` with every block stored and default settings: the header
    (22 fixed bytes, two varints, one bit per block, the payload length, the CRC) + data."""
    varint = lambda n: max(1, -(-n.bit_length() // 7))  # noqa: E731
    return 22 + varint(len(data)) + 1 + (blocks + 7) // 8 + 1 + 4 + len(data)


def roundtrip(lm, data: bytes, adapt=None, streams=None) -> bytes:
    blob, result = compress_bytes(lm, data, adapt, streams)
    back, _ = decompress_bytes(lm, blob)
    assert back == data
    assert len(blob) <= stored_size(data, result.blocks) + (17 if adapt else 0)  # never expands
    return blob


def repeats(unit: st.SearchStrategy) -> st.SearchStrategy:
    return st.tuples(unit, st.integers(2, 40)).map(lambda t: t[0] * t[1])


@SLOW
@given(text=st.text(max_size=80), kind=st.sampled_from(["char", "byte", "bpe"]),
       adapt=st.booleans(), streams=st.sampled_from([None, 1, 3]))
def test_roundtrip_any_unicode(lms, text, kind, adapt, streams):
    roundtrip(lms[kind], text.encode("utf-8", "surrogatepass"), ADAPT if adapt else None, streams)


@SLOW
@given(data=st.binary(max_size=80) | repeats(st.binary(min_size=1, max_size=8)),
       kind=st.sampled_from(["char", "byte", "bpe"]), adapt=st.booleans())
def test_roundtrip_any_bytes(lms, data, kind, adapt):
    roundtrip(lms[kind], data, ADAPT if adapt else None, 2)


TEXT_OR_BYTES = (st.binary(max_size=160) | st.text(max_size=80).map(lambda t: t.encode("utf-8", "surrogatepass"))
                 | repeats(st.text(min_size=1, max_size=6).map(lambda t: t.encode("utf-8", "surrogatepass")))
                 | st.tuples(st.integers(0, 120), st.binary(max_size=60), st.integers(0, 120)).map(
                     lambda t: shakespeare_text(t[0]).encode() + t[1] + shakespeare_text(t[2]).encode()))


@SLOW
@given(data=TEXT_OR_BYTES, kind=st.sampled_from(["char", "byte", "bpe"]), adapt=st.booleans(),
       streams=st.sampled_from([None, 1, 3]), block=st.integers(1, 24))
def test_roundtrip_across_blocks(lms, data, kind, adapt, streams, block):
    """Blocks of a few bytes (patched in for the test): many per stream, characters cut at
    block edges, stored and model-coded blocks side by side in one stream."""
    with mock.patch.object(modelcoder, "BLOCK_BYTES", block):
        blob = roundtrip(lms[kind], data, ADAPT if adapt else None, streams)
        header, _ = Header.unpack(blob, "f")
        assert len(header.coded) == len(Layout.choose(data, streams).blocks())
        assert len(header.coded) >= -(-len(data) // block)


def test_layout_covers_the_file_in_blocks_of_at_most_64_kib():
    for length, streams in ((0, 0), (1, 1), (65_536, 1), (65_537, 1), (1_000_003, 7), (300_000, 64)):
        blocks = Layout(length, streams).blocks()
        assert [b[1] for b in blocks[1:]] == [b[2] for b in blocks[:-1]]  # contiguous
        assert sum(z - a for _, a, z in blocks) == length
        assert all(0 < z - a <= 65_536 for _, a, z in blocks)
        assert [b[0] for b in blocks] == sorted(b[0] for b in blocks)
        assert len({b[0] for b in blocks}) == streams
    assert len(Layout(65_537, 1).blocks()) == 2
    assert Layout.choose(b"", None).streams == 0
    assert Layout.choose(LINE * 2000, None).streams == 1  # repetitive: one long history
    assert Layout.choose(random.Random(0).randbytes(300_000), None).streams == 64


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
    ext = alpha.extend(sym, esc)
    assert ((0 <= ext) & (ext < alpha.vocab + 256 * alpha.escape)).all()
    back_sym, back_esc = alpha.split(ext)
    assert (back_sym == sym).all() and alpha.decode(back_sym, back_esc) == data


@pytest.mark.parametrize("sharpen", [1.0, 30.0])
def test_size_within_half_a_percent_of_the_model_code_length(tmp_path, sharpen):
    text = shakespeare_text(30_000)
    lm = make_lm(CharTokenizer(text), tmp_path, seed=1, sharpen=sharpen)
    data = text[24_000:].encode()  # 6000 characters
    for adapt in (None, ADAPT):
        blob, r = compress_bytes(lm, data, adapt, streams=4)
        header, pos = Header.unpack(blob, "f")
        blocks = Layout(header.length, header.streams).blocks()
        stored = sum(z - a for (_, a, z), c in zip(blocks, header.coded, strict=True) if not c)
        payload = len(blob) - pos - stored  # the range coder's bytes
        assert r.stored_blocks < r.blocks
        assert payload <= r.coded_bits / 8 * 1.005 + 4, (payload, r.coded_bits / 8)
        assert decompress_bytes(lm, blob)[0] == data


def test_adapt_is_deterministic_and_differs_from_static(lms):
    data = shakespeare_text(1000).encode()
    a = roundtrip(lms["char"], data, ADAPT)
    assert a == compress_bytes(lms["char"], data, ADAPT)[0]
    assert a != compress_bytes(lms["char"], data)[0]


def test_random_bytes_are_stored_not_expanded(lms):
    data = random.Random(1).randbytes(20_000)
    for kind in ("char", "byte"):
        blob, r = compress_bytes(lms[kind], data)
        assert r.stored_blocks == r.blocks > 1
        assert len(blob) == stored_size(data, r.blocks) <= len(data) + 40
        assert decompress_bytes(lms[kind], blob)[0] == data


def test_only_the_blocks_the_model_cannot_shrink_are_stored(lms):
    """One stream, three blocks: text, random bytes, text. The middle one is stored; the
    model still reads it, so the third block decodes with the same state and history."""
    text = shakespeare_text(1200).encode()
    data = text[:600] + random.Random(2).randbytes(600) + text[600:]
    with mock.patch.object(modelcoder, "BLOCK_BYTES", 600):
        for adapt in (None, ADAPT):
            blob, r = compress_bytes(lms["char"], data, adapt, streams=1)
            header, _ = Header.unpack(blob, "f")
            assert header.coded == (True, False, True) and r.stored_blocks == 1
            assert len(blob) < stored_size(data, 3) - 200
            assert decompress_bytes(lms["char"], blob)[0] == data


@pytest.mark.parametrize("kind", ["char", "byte"])
def test_long_repeats_cost_nearly_nothing(lms, kind):
    """The match model: 99 more copies of a 54-byte line (accents, CJK, emoji: escapes for
    a char model) add a few dozen bytes, not 99 times the line's cost."""
    lm = lms[kind]
    once, _ = compress_bytes(lm, LINE)
    many, r = compress_bytes(lm, LINE * 100)
    assert r.streams == 1 and r.stored_blocks == 0
    assert len(many) - len(once) < 40, (len(once), len(many))
    assert decompress_bytes(lm, many)[0] == LINE * 100


def test_header_is_small(lms):
    """An empty file is 29 bytes (xz: 32); a short text's header is a few dozen bytes."""
    for kind in ("char", "byte", "bpe"):
        blob, r = compress_bytes(lms[kind], b"")
        assert len(blob) == r.header_bytes == 29
        assert decompress_bytes(lms[kind], blob)[0] == b""
    blob, r = compress_bytes(lms["char"], shakespeare_text(3000).encode())
    assert r.header_bytes <= 36
    blob, r = compress_bytes(lms["char"], b"x", ADAPT)
    assert r.header_bytes <= 29 + 2 + 17  # --adapt's settings, when not the defaults


def test_compressing_twice_gives_the_same_bytes(lms):
    data = shakespeare_text(1500).encode() + LINE * 3
    assert compress_bytes(lms["char"], data)[0] == compress_bytes(lms["char"], data)[0]


def _reheader(blob: bytes, **change) -> bytes:
    """blob with header fields changed and its CRC recomputed: a well-formed file that
    differs only in those fields."""
    header, pos = Header.unpack(blob, "f")
    fields = {**header.__dict__, **change}
    return Header(**fields).pack() + blob[pos:]


def test_refuses_an_older_format_and_another_kernel_path(lms):
    lm = lms["char"]
    blob, _ = compress_bytes(lm, shakespeare_text(500).encode())
    old = b"ZLMZ\x01\x00" + bytes(130)  # what version 1 wrote first
    with pytest.raises(CompressedFileError, match=r"format version 1; this zlm reads version 2"):
        decompress_bytes(lm, old, "f")
    with pytest.raises(CompressedFileError, match="another kernel path"):
        decompress_bytes(lm, _reheader(blob, kernel=b"\0\0\0\0"), "f")
    with pytest.raises(CompressedFileError, match="different model"):
        decompress_bytes(lm, _reheader(blob, model=bytes(8)), "f")
    with pytest.raises(CompressedFileError, match="fails its checksum"):
        decompress_bytes(lm, _reheader(blob, checksum=Header.unpack(blob, "f")[0].checksum ^ 1), "f")


def test_static_coding_runs_the_decoder_on_every_core_and_older_files_still_decode(lms, monkeypatch):
    """Static files are coded with the C++ Decoder (its sums do not depend on the thread
    count: the same bytes on 1 or 2 threads); a file coded with the one-thread "cpp" step,
    as zlm wrote them before, still decodes; --adapt keeps the "cpp" step."""
    import zlm.inference.compress as compress
    from zlm.model.cells import cpu_ext

    if cpu_ext.load_extension() is None:
        pytest.skip(f"no compiled step: {cpu_ext.unavailable_reason()}")
    lm, data = lms["char"], shakespeare_text(3000).encode()
    assert compress.coder_kernel(None) == "decode" and compress.coder_kernel(ADAPT) == "cpp"
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = compress_bytes(lm, data)
        torch.set_num_threads(2)
        two, _ = compress_bytes(lm, data)
    finally:
        torch.set_num_threads(before)
    assert one == two and Header.unpack(one, "f")[0].kernel == compress.kernel_id("fp32", "decode")
    assert decompress_bytes(lm, one, "f")[0] == data
    monkeypatch.setattr(compress, "coder_kernel", lambda adapt: "cpp")
    legacy, _ = compress_bytes(lm, data)
    assert Header.unpack(legacy, "f")[0].kernel == compress.kernel_id("fp32", "cpp") != compress.kernel_id(
        "fp32", "decode")
    monkeypatch.undo()
    assert decompress_bytes(lm, legacy, "f")[0] == data


@pytest.mark.parametrize("adapt", [None, ADAPT])
def test_a_vocabulary_without_the_table_has_its_own_kernel_path(lms, monkeypatch, adapt):
    """Where the model's table of layer 0's pre-activations would pass TABLE_MAX_BYTES (a
    large sentencepiece vocabulary) the step multiplies the embedding instead: other sums, so
    the kernel path says so, files round-trip, and a file coded through the table is refused
    in one line rather than decoded wrong."""
    import zlm.inference.compress as compress
    from zlm.model.cells import decoder_tiles

    lm, data = lms["char"], shakespeare_text(1500).encode()
    looked_up, _ = compress_bytes(lm, data, adapt)
    monkeypatch.setattr(decoder_tiles, "TABLE_MAX_BYTES", 0)
    blob, _ = compress_bytes(lm, data, adapt)
    kernel = compress.coder_kernel(adapt)
    assert " layer0-product/" in compress.kernel_path(kernel, adapt is not None, 0, False)
    assert "layer0" not in compress.kernel_path(kernel, adapt is not None, 0)
    assert Header.unpack(blob, "f")[0].kernel == compress.kernel_id(
        "fp32", kernel, adapt is not None, lm.model_config.hidden, False) != Header.unpack(looked_up, "f")[0].kernel
    assert decompress_bytes(lm, blob, "f")[0] == data
    with pytest.raises(CompressedFileError, match="another kernel path"):
        decompress_bytes(lm, looked_up, "f")


def test_an_adapt_file_names_the_cells_recurrent_product(lms, monkeypatch):
    """--adapt runs the model's cell over windows on both sides: a file coded where its fp32
    product is MKL's says so in its kernel id and is refused, in one line, where the product
    is oneDNN's (the arithmetic differs); with oneDNN's the id is what it was before the MKL
    path existed, and such files decode where MKL's is the default (through oneDNN's)."""
    import zlm.inference.compress as compress
    from zlm.model.cells import compiled, cpu_ext

    ext = cpu_ext.load_extension()
    if ext is None or not ext.mkl_packed_ready():
        pytest.skip("no MKL packed GEMM here")
    monkeypatch.setattr(compiled, "on_intel", lambda: True)
    monkeypatch.setattr(compiled, "TRANSPOSED_GRADS", True)  # the weight gradients' marker: its own test
    lm, data = lms["char"], shakespeare_text(1200).encode()
    blob, _ = compress_bytes(lm, data, ADAPT)
    assert Header.unpack(blob, "f")[0].kernel == compress.kernel_id("fp32", "cpp", True)
    assert compress.kernel_path("cpp", True) == compress.kernel_path("cpp") + " cell-mkl"
    assert decompress_bytes(lm, blob, "f")[0] == data
    monkeypatch.setattr(compiled, "USE_MKL", False)
    with pytest.raises(CompressedFileError, match="another kernel path"):
        decompress_bytes(lm, blob, "f")
    assert compress.kernel_id("fp32", "cpp", True) == compress.kernel_id("fp32", "cpp")
    onednn, _ = compress_bytes(lm, data, ADAPT)
    assert decompress_bytes(lm, onednn, "f")[0] == data
    # Where MKL's product is the default, a file coded through oneDNN's (as every file was
    # before the MKL path) decodes through oneDNN's, for that file alone.
    monkeypatch.setattr(compiled, "USE_MKL", True)
    assert compress._matching_kernel(lm, Header.unpack(onednn, "f")[0], "f")[1].get("USE_MKL") is False
    assert decompress_bytes(lm, onednn, "f")[0] == data and compiled.USE_MKL is True


def test_an_adapt_file_names_the_vendor_where_mkl_runs_on_another_cpu(lms, monkeypatch):
    """On a CPU not made by Intel, MKL's product runs only up to MKL_ELSEWHERE_MAX_HIDDEN
    units: a small model's --adapt file names MKL and the vendor (MKL picks its code by CPU,
    so an Intel-coded file is refused there, and the other way round), a larger model's
    names neither and decodes where oneDNN's product runs."""
    import zlm.inference.compress as compress
    from zlm.model.cells import compiled, cpu_ext

    ext = cpu_ext.load_extension()
    if ext is None or not ext.mkl_packed_ready():
        pytest.skip("no MKL packed GEMM here")
    lm, data = lms["char"], shakespeare_text(1200).encode()
    hidden = lm.model_config.hidden
    assert hidden <= compiled.MKL_ELSEWHERE_MAX_HIDDEN
    monkeypatch.setattr(compiled, "TRANSPOSED_GRADS", True)  # the weight gradients' marker: its own test
    monkeypatch.setattr(compiled, "on_intel", lambda: True)
    intel, _ = compress_bytes(lm, data, ADAPT)
    monkeypatch.setattr(compiled, "on_intel", lambda: False)
    monkeypatch.setattr(compress, "cpu_vendor", lambda: "AuthenticAMD")
    assert compress.kernel_path("cpp", True, hidden) == compress.kernel_path("cpp") + " cell-mkl-AuthenticAMD"
    with pytest.raises(CompressedFileError, match="another kernel path"):
        decompress_bytes(lm, intel, "f")
    amd, _ = compress_bytes(lm, data, ADAPT)
    assert Header.unpack(amd, "f")[0].kernel == compress.kernel_id("fp32", "cpp", True, hidden)
    assert decompress_bytes(lm, amd, "f")[0] == data
    monkeypatch.setattr(compiled, "on_intel", lambda: True)
    with pytest.raises(CompressedFileError, match="another kernel path"):
        decompress_bytes(lm, amd, "f")
    monkeypatch.setattr(compiled, "on_intel", lambda: False)
    monkeypatch.setattr(compiled, "MKL_ELSEWHERE_MAX_HIDDEN", hidden - 1)  # this model is past it: oneDNN
    assert compress.kernel_path("cpp", True, hidden) == compress.kernel_path("cpp")
    onednn, _ = compress_bytes(lm, data, ADAPT)
    assert decompress_bytes(lm, onednn, "f")[0] == data


def test_an_adapt_file_names_the_cells_weight_gradient_path(lms, monkeypatch):
    """--adapt's steps take the cell's weight gradients too: a file coded where they are
    torch.mm on the window's buffers (CPUs without AVX-512) says " grads-mm" in its kernel id;
    with the transposed copies the id is what it was before the views existed. The compiled
    cell has both paths everywhere, so a file coded under either decodes under the other
    setting too: the decoder finds the path whose id is the file's and runs it for the file
    alone (the arithmetic differs between them)."""
    import zlm.inference.compress as compress
    from zlm.model.cells import compiled, cpu_ext

    ext = cpu_ext.load_extension()
    if ext is None or compiled.recurrent_backend(ext, hidden=lms["char"].model_config.hidden) == "addmm":
        pytest.skip("no compiled fp32 time loop here")
    lm, data = lms["char"], shakespeare_text(1200).encode()
    hidden = lm.model_config.hidden
    monkeypatch.setattr(compiled, "TRANSPOSED_GRADS", True)
    copies, _ = compress_bytes(lm, data, ADAPT)
    assert " grads-mm" not in compress.kernel_path("cpp", True, hidden)
    assert decompress_bytes(lm, copies, "f")[0] == data
    monkeypatch.setattr(compiled, "TRANSPOSED_GRADS", False)
    assert compress.kernel_path("cpp", True, hidden).endswith(" grads-mm")
    assert " grads-mm" not in compress.kernel_path("cpp", False, hidden)  # static coding runs no backward
    views, _ = compress_bytes(lm, data, ADAPT)
    assert Header.unpack(views, "f")[0].kernel != Header.unpack(copies, "f")[0].kernel
    header = Header.unpack(copies, "f")[0]
    assert compress._matching_kernel(lm, header, "f")[1].get("TRANSPOSED_GRADS") is True
    assert decompress_bytes(lm, copies, "f")[0] == data and compiled.TRANSPOSED_GRADS is False  # restored
    monkeypatch.setattr(compiled, "TRANSPOSED_GRADS", True)
    assert compress._matching_kernel(lm, Header.unpack(views, "f")[0], "f")[1].get("TRANSPOSED_GRADS") is False
    assert decompress_bytes(lm, views, "f")[0] == data and compiled.TRANSPOSED_GRADS is True


def test_refuses_damage_truncation_and_another_model(lms, tmp_path):
    lm = lms["char"]
    data = shakespeare_text(2000).encode()
    blob, _ = compress_bytes(lm, data)
    _, pos = Header.unpack(blob, "f")
    cases = {
        "truncated": blob[: pos + (len(blob) - pos) // 2],
        "truncated (its header": blob[:20],
        "header fails its CRC": blob[:10] + bytes((blob[10] ^ 1,)) + blob[11:],
        "fails its checksum": blob[: pos + 40] + bytes((blob[pos + 40] ^ 0x10,)) + blob[pos + 41 :],
        "not a zlm compressed file": b"PK\x03\x04" + blob[4:],
        "format version 9": blob[:4] + b"\x09" + blob[5:],
        "bytes after the coded data": blob + b"\0",
    }
    for expect, bad in cases.items():
        with pytest.raises(CompressedFileError, match=re.escape(expect)):
            decompress_bytes(lm, bad, "f")
    other = make_lm(lm.tokenizer, tmp_path / "other", seed=5)
    with pytest.raises(CompressedFileError, match="different model"):
        decompress_bytes(other, blob, "f")


@pytest.fixture(scope="module")
def blobs(lms):
    data = shakespeare_text(300).encode() + LINE + random.Random(4).randbytes(40)
    with mock.patch.object(modelcoder, "BLOCK_BYTES", 64):
        return data, {kind: compress_bytes(lms[kind], data, None, 2)[0] for kind in ("char", "bpe")}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["char", "bpe"]), at=st.floats(0, 1), flip=st.integers(1, 255),
       cut=st.booleans())
@example(kind="char", at=1.0, flip=2, cut=False)  # in the flush's slack: decodes to the original
def test_any_damage_is_a_one_line_error(lms, blobs, kind, at, flip, cut):
    """A flipped byte anywhere, or a file cut anywhere: a one-line CompressedFileError, nothing
    else, and never other bytes than the original. The one exception: the range coder's
    final 4 bytes (its flush) have slack bits (any value inside its last interval decodes
    the same), so a flip there may decode, to exactly the original bytes (their CRC-32 and
    length are checked)."""
    data, packed = blobs
    blob = packed[kind]
    i = min(len(blob) - 1, int(at * len(blob)))
    bad = blob[:i] if cut else blob[:i] + bytes((blob[i] ^ flip,)) + blob[i + 1 :]
    with mock.patch.object(modelcoder, "BLOCK_BYTES", 64):
        try:
            got, _ = decompress_bytes(lms[kind], bad, "f")
        except CompressedFileError as err:
            assert "\n" not in str(err)
        else:
            assert not cut and i >= len(blob) - 4 and got == data

