"""The engine of `zlm serve`: continuous batching that changes no request's text.

Requests of different primes, seeds, lengths, temperatures, top-k and top-p run at once,
joining and leaving the batch at different steps through a few slots (rows are compacted
as they go), and each comes out as `zlm.load(...).sample(...)` - the function behind
`zlm sample` - makes it alone with the same seed. Also: cancelling frees the slot at once,
the time limit ends a generation, a full engine refuses.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from serve_fixtures import tiny_run

import zlm
from zlm.inference.sample import SampleConfig, generate
from zlm.serve.engine import Busy, Engine, ModelThread
from zlm.serve.params import encode_text
from zlm.serve.server import load_models

# (prime, length, temperature, top_k, top_p, seed): plain draws at two temperatures, greedy,
# top-k, top-p, a one-token request, a prime longer than the 512-token prime window, and
# lengths past the 256-token blocks of uniforms.
REQUESTS = [
    ("ROMEO:", 300, 1.0, None, None, 11),
    ("", 37, 0.7, None, None, 12),
    ("First Citizen:\nWe are", 120, 0.0, None, None, 13),
    ("king", 1, 1.0, None, None, 14),
    ("the ", 530, 1.0, None, None, 15),
    ("To be", 90, 1.3, 5, None, 16),
    ("O, ", 200, 0.9, None, 0.8, 17),
    ("", 260, 0.7, None, None, 18),
    ("the " * 175, 64, 1.0, None, None, 19),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("serve-engine"))


def _cfg(prime, length, temperature, top_k, top_p, seed) -> SampleConfig:
    return SampleConfig(length=length, prime=prime, temperature=temperature, top_k=top_k, top_p=top_p,
                        seed=seed)


async def _serve_all(engine: Engine, lm, configs: list[SampleConfig]) -> list[tuple[str, float]]:
    """Submit each config as a slot frees (a few start together, the rest join later);
    return each one's (text, nats)."""
    await engine.start()
    try:
        async def one(cfg: SampleConfig, delay: float):
            await asyncio.sleep(delay)
            while True:
                try:
                    gen = engine.submit(cfg, encode_text(lm, cfg.prime, "error", "prime"))
                    break
                except Busy:
                    await asyncio.sleep(0.001)
            text = "".join([p async for p in gen.pieces()])
            assert gen.finish_reason == "length"
            return text, gen.nats

        return await asyncio.gather(*(one(c, 0.002 * i) for i, c in enumerate(configs)))
    finally:
        await engine.close()
    assert engine.in_use == 0


@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_concurrent_requests_make_the_text_zlm_sample_makes_alone(run, kernel):
    thread = ModelThread()
    sample_lm, _ = thread.run(load_models, run, "cpu", "auto")
    engine = Engine(sample_lm, max_streams=4, kernel=kernel, thread=thread)
    configs = [_cfg(*r) for r in REQUESTS]
    got = asyncio.run(_serve_all(engine, sample_lm, configs))
    assert engine.rows.kernel == ("decode" if kernel == "auto" else "torch")
    alone = zlm.load(run, device="cpu", precision="auto")
    for cfg, (text, nats) in zip(configs, got, strict=True):
        if kernel == "auto":  # the function behind `zlm sample`, as users call it
            want = alone.sample(cfg.prime, cfg.length, temperature=cfg.temperature, top_k=cfg.top_k,
                                top_p=cfg.top_p, seed=cfg.seed)[len(cfg.prime):]
            assert text == want, cfg
        ref = generate(alone, cfg, kernel=kernel)[0]
        assert text == ref.text, cfg
        assert nats == pytest.approx(ref.nats, rel=1e-6)


def _engine(run, **kw):
    thread = ModelThread()
    sample_lm, _ = thread.run(load_models, run, "cpu", "auto")
    return Engine(sample_lm, thread=thread, **kw), sample_lm


def test_cancel_frees_the_slot_at_once(run):
    engine, lm = _engine(run, max_streams=2)

    async def go():
        await engine.start()
        try:
            gen = engine.submit(SampleConfig(length=10**7, seed=1), encode_text(lm, "", "error", "prime"))
            first = await gen.pieces().__anext__()
            assert first and engine.in_use == 1
            t0 = time.monotonic()
            engine.cancel(gen)
            await asyncio.wait_for(gen.released.wait(), 1.0)
            assert engine.in_use == 0 and gen.finish_reason == "cancelled"
            return time.monotonic() - t0
        finally:
            await engine.close()

    assert asyncio.run(go()) < 0.2


def test_the_time_limit_ends_a_generation(run):
    engine, lm = _engine(run, max_streams=2, timeout_s=0.3)

    async def go():
        await engine.start()
        try:
            gen = engine.submit(SampleConfig(length=10**7, seed=1), encode_text(lm, "", "error", "prime"))
            text = "".join([p async for p in gen.pieces()])
            assert gen.finish_reason == "time" and 0 < len(text) < 10**7
            assert engine.in_use == 0
        finally:
            await engine.close()

    asyncio.run(go())


def test_a_full_engine_refuses(run):
    engine, lm = _engine(run, max_streams=2)

    async def go():
        await engine.start()
        try:
            cfg = SampleConfig(length=10**7, seed=1)
            held = [engine.submit(cfg, encode_text(lm, "", "error", "prime")) for _ in range(2)]
            with pytest.raises(Busy, match="all 2 streams are busy"):
                engine.submit(cfg, encode_text(lm, "", "error", "prime"))
            for gen in held:
                engine.cancel(gen)
                await gen.released.wait()
            assert engine.in_use == 0
            engine.submit(SampleConfig(length=5, seed=1), encode_text(lm, "", "error", "prime"))
        finally:
            await engine.close()

    asyncio.run(go())
