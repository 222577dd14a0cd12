"""The engine of `zlm serve`: one scheduler task, one model thread, continuous batching.

Requests come in on the event loop (`Engine.submit`) and leave it as `Generation`s, each
an asyncio queue of text pieces. One scheduler task (`Engine._schedule`) loops: it hands
one round of work to the model thread and, when the round returns, delivers its text to
the queues. A round (`Engine._round`, on the model thread) runs the jobs waiting for the
model (`Engine.call`: scoring), drops the generations that finished, were cancelled or
ran out of time, prefills and adds those that arrived, then steps every active row
together for up to `budget_s` (`zlm.serve.batch.Rows.run`). A request that arrives or is
cancelled during a round ends it at the next step (`_kick`), so rows join and leave
between steps and the event loop stays free while the model works.

All model work - prefill, the batched step, scoring - runs on that one thread: the model
reuses workspaces across calls and is never entered twice at once.

Slots: a request holds one from `submit` until its generation is over (done, cancelled,
timed out or failed); `submit` past `max_streams` raises `Busy` (HTTP 503). `in_use` is
what /healthz reports, and the load test checks it returns to zero.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

from zlm.inference.sample import SampleConfig, encode_prime
from zlm.serve.batch import Rows, Stream

log = logging.getLogger("zlm.serve")
ADMIT_BUDGET_S = 0.02  # prefill time per round at most (the rest join in the next round)
FIRST_BUDGET_S = 0.001  # the run of steps right after rows joined: their first text goes out soon


class ModelThread:
    """The one thread that runs the model - loading it too, where the command can.

    torch's OpenMP pool belongs to the thread that first runs a parallel region; a second
    thread running them gets a pool of its own, and with more pool threads than cores
    OpenMP stops spinning between regions, which makes each step of a small model about
    twice as slow. So all torch work of the server happens here.
    """

    def __init__(self):
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="zlm-serve-model")

    def run(self, fn: Callable, *args):
        """fn(*args) on this thread, waiting for it (before the event loop starts)."""
        return self.pool.submit(fn, *args).result()


class Busy(Exception):
    """Every slot is taken (HTTP 503 with Retry-After)."""


class Generation:
    """One request's generation, as the event loop sees it."""

    def __init__(self, stream: Stream, deadline: float):
        self.stream = stream
        self.seed = stream.seed
        self.deadline = deadline  # time.monotonic() after which it stops with reason "time"
        self.cancelled = False  # set on the loop; the model thread drops it at the next step
        self.over = False  # set on the model thread: finished or dropped (never stepped again)
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()  # pieces, then None
        self.finish_reason: str | None = None  # length | time | cancelled | error
        self.error: str | None = None
        self.released = asyncio.Event()

    async def pieces(self) -> AsyncIterator[str]:
        """The text as it is made; ends when the generation is over."""
        while (item := await self.queue.get()) is not None:
            yield item

    @property
    def tokens(self) -> int:
        return self.stream.produced

    @property
    def nats(self) -> float:
        return self.stream.nats


class Engine:
    """Continuous batching over one loaded model (see the module docstring).

    lm: the `LoadedModel` to sample from (its runtime precision decides bf16 weights in
    the step, as for `zlm sample`). max_streams: slots, and the batch's capacity.
    timeout_s: a generation's time limit. budget_s: the longest run of steps between two
    deliveries of text. kernel: the Stepper's ("auto": what `zlm sample` runs). thread:
    the `ModelThread` the model was loaded on (default: a new one).
    """

    def __init__(self, lm, max_streams: int = 32, timeout_s: float = 120.0, budget_s: float = 0.005,
                 kernel: str = "auto", thread: ModelThread | None = None):
        self.lm, self.max_streams, self.timeout_s, self.budget_s = lm, max_streams, timeout_s, budget_s
        self.kernel = kernel
        self.in_use = 0
        self.rows: Rows | None = None
        self._pool = (thread or ModelThread()).pool
        self._pending: deque[Generation] = deque()  # submitted, not yet a row
        self._active: list[Generation] = []  # the rows, in order (model thread)
        self._jobs: deque[tuple[Callable, tuple, asyncio.Future]] = deque()
        self._kick = False  # end the current run of steps: a request arrived or left
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closed = False

    def prepare(self) -> None:
        """Build the batch on the model thread - pack the weights, compile the extension on
        first use - and run one prime through the model, so that the first request does
        not pay for its first use (`start` prepares if this was not called)."""
        if self.rows is None:
            self.rows = self._pool.submit(self._build).result()

    def _build(self) -> Rows:
        rows = Rows(self.lm, self.max_streams, self.kernel)
        rows.prefill(encode_prime(self.lm, ""))
        return rows

    async def start(self) -> None:
        """Prepare (off the event loop) and start the scheduler task."""
        self._wakeup = asyncio.Event()
        await asyncio.get_running_loop().run_in_executor(None, self.prepare)
        self._task = asyncio.create_task(self._schedule(), name="zlm-serve-scheduler")

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for gen in [*self._pending, *self._active]:
            self._finish(gen, "error", "the server is shutting down")
        self._pending.clear()
        self._active = []
        for _, _, fut in self._jobs:
            if not fut.done():
                fut.set_exception(RuntimeError("the server is shutting down"))
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ the event loop's side

    def submit(self, cfg: SampleConfig, prime_ids: Tensor) -> Generation:
        """Take a slot and queue a generation (Busy when every slot is taken)."""
        if self._closed or self.rows is None:
            raise Busy("the server is not running")
        if self.in_use >= self.max_streams:
            raise Busy(f"all {self.max_streams} streams are busy")
        seed = cfg.seed if cfg.seed is not None else secrets.randbits(31)
        gen = Generation(Stream(self.lm, cfg, prime_ids, seed, self.rows.ext),
                         time.monotonic() + self.timeout_s)
        self.in_use += 1
        self._pending.append(gen)
        self._poke()
        return gen

    def cancel(self, gen: Generation) -> None:
        """Stop a generation (its client left): its slot is freed after the current step."""
        if not gen.released.is_set() and not gen.cancelled:
            gen.cancelled = True
            self._poke()

    async def call(self, fn: Callable, *args):
        """fn(*args) on the model thread, between two runs of steps."""
        fut = asyncio.get_running_loop().create_future()
        self._jobs.append((fn, args, fut))
        self._poke()
        return await fut

    def _poke(self) -> None:
        self._kick = True
        if self._wakeup is not None:
            self._wakeup.set()

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not (self._pending or self._active or self._jobs):
                self._wakeup.clear()
                await self._wakeup.wait()
            events = await loop.run_in_executor(self._pool, self._round)
            for event in events:
                event()

    def _finish(self, gen: Generation, reason: str, error: str | None = None) -> None:
        """On the loop: the generation is over; free its slot."""
        if gen.released.is_set():
            return
        gen.finish_reason, gen.error = reason, error
        gen.queue.put_nowait(None)
        gen.released.set()
        self.in_use -= 1

    def _text(self, gen: Generation, text: str) -> None:
        if not gen.released.is_set():
            gen.queue.put_nowait(text)

    # ------------------------------------------------------------------ the model thread's side

    def _round(self) -> list[Callable[[], None]]:
        """One round on the model thread; returns what the loop must deliver."""
        self._kick = False
        events: list[Callable[[], None]] = []
        try:
            with torch.no_grad():
                self._run_jobs(events)
                joined = self._regroup(events)
                self.rows.run(FIRST_BUDGET_S if joined else self.budget_s, lambda: self._kick)
                for gen in self._active:
                    text = gen.stream.take_text()
                    if text:
                        events.append(lambda g=gen, t=text: self._text(g, t))
                    if gen.stream.remaining == 0:
                        gen.over = True
                        events.append(lambda g=gen: self._finish(g, "length"))
        except Exception as e:  # a bug: fail what is running, keep serving
            log.exception("zlm serve: a round of the batch failed")
            for gen in [*self._active, *self._pending]:
                gen.over = True
                events.append(lambda g=gen, m=f"internal error ({type(e).__name__})": self._finish(g, "error", m))
            self._active, self._pending = [], deque()
            self.rows = Rows(self.lm, self.max_streams, self.kernel)
        return events

    def _run_jobs(self, events: list) -> None:
        while self._jobs:
            fn, args, fut = self._jobs.popleft()
            try:
                result = fn(*args)
                events.append(lambda f=fut, r=result: f.done() or f.set_result(r))
            except Exception as e:  # noqa: BLE001 (handed to the caller)
                events.append(lambda f=fut, x=e: f.done() or f.set_exception(x))

    def _regroup(self, events: list) -> bool:
        """Drop the rows that are over, cancelled or out of time; add the arrivals (True
        when some joined)."""
        now = time.monotonic()
        keep = []
        for i, gen in enumerate(self._active):
            if gen.over:
                continue
            if gen.cancelled or now > gen.deadline:
                gen.over = True
                reason = "cancelled" if gen.cancelled else "time"
                events.append(lambda g=gen, r=reason: self._finish(g, r))
                continue
            keep.append(i)
        joining = []
        start = time.perf_counter()
        while self._pending and len(keep) + len(joining) < self.max_streams:
            if joining and time.perf_counter() - start > ADMIT_BUDGET_S:
                self._kick = True  # the others join at the next round
                break
            gen = self._pending.popleft()
            if gen.cancelled:
                gen.over = True
                events.append(lambda g=gen: self._finish(g, "cancelled"))
                continue
            try:
                joining.append((gen, self.rows.prefill(gen.stream.prime_ids)))
            except Exception as e:  # noqa: BLE001 (this request fails, the others go on)
                gen.over = True
                events.append(lambda g=gen, m=str(e).splitlines()[0]: self._finish(g, "error", m))
        self.rows.regroup(keep, [(g.stream, state) for g, state in joining])
        self._active = [self._active[i] for i in keep] + [g for g, _ in joining]
        return bool(joining)
