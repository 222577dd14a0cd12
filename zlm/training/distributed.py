"""The only module that touches torch.distributed, DDP and ZeRO.

`setup(device, zero)` reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK; set by
torchrun, by `zlm train --nproc` and by any torch elastic agent), joins the process group
and returns a `Parallel`; the trainer calls its methods and never branches on the world
size. With no such environment it is a single process and every method is trivial.

What the multi-process `Parallel` does, and why:

- Backend: nccl for a CUDA device (one GPU per local rank), gloo for CPU. Every collective
  has a finite timeout, `ZLM_DIST_TIMEOUT` seconds (default 300), so a dead or stuck rank
  ends the job with an error instead of a hang.
- Model: DistributedDataParallel, which broadcasts rank 0's weights at construction and
  averages gradients. Every rank carries B streams of equal window length, so the averaged
  gradient is the gradient of the mean loss over all W*B streams: W ranks with batch B
  train exactly like one process with batch W*B (up to float summation order).
- Optimizer: `--zero` wraps it in ZeroRedundancyOptimizer (ZeRO stage 1: each rank keeps
  the optimizer state of a subset of whole tensors and broadcasts the parameters it
  updated). Checkpoints hold the consolidated full state, so they load with or without
  ZeRO and at any world size.
- Hidden state: each rank carries its own (L, B, H); checkpoints gather it into the
  (L, W*B, H) of all streams, and a resumed run takes its slice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch import nn

from zlm.errors import UsageError, ZlmError

TIMEOUT_ENV = "ZLM_DIST_TIMEOUT"
DEFAULT_TIMEOUT = 300.0  # seconds; also how long rank 0 may spend writing one checkpoint


def local_rank() -> int:
    """LOCAL_RANK from the launcher (0 without one): which GPU this process uses."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def rank_from_env() -> int:
    """RANK from the launcher (0 without one), readable before the process group exists."""
    return int(os.environ.get("RANK", "0"))


def world_from_env() -> int:
    """WORLD_SIZE from the launcher (1 without one)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def restart_count() -> int:
    """How often the elastic agent (torchrun --max-restarts) has restarted this job."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def collective_timeout() -> float:
    """ZLM_DIST_TIMEOUT in seconds (default 300): the longest any collective may wait."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UsageError(f"{TIMEOUT_ENV}={raw!r} is not a positive number of seconds; set e.g. {TIMEOUT_ENV}=300")
    return value


@dataclass
class Parallel:
    """This process's place in the job, and the few collective operations training needs."""

    rank: int = 0
    world: int = 1
    zero: bool = False  # --zero was asked for (it needs several processes to do anything)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def restarted(self) -> bool:
        """True in workers an elastic agent relaunched after a failure: they should resume."""
        return restart_count() > 0

    def describe(self) -> str:
        """One line for the start info: processes, backend, ZeRO shard sizes."""
        return "1 process" + (" (--zero needs several processes; ignored)" if self.zero else "")

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def make_optimizer(self, cls: type, params, **kwargs) -> torch.optim.Optimizer:
        """The optimizer (ZeroRedundancyOptimizer around cls under --zero)."""
        return cls(params, **kwargs)

    def sum(self, values: list[float]) -> list[float]:
        """Sum floats across ranks (float64)."""
        return list(values)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a tensor across ranks in place, on its device (no host read)."""
        return t

    def local_optimizer(self, optimizer) -> torch.optim.Optimizer:
        """The optimizer that steps this rank's parameters (ZeRO's inner one under --zero)."""
        return getattr(optimizer, "optim", optimizer)

    def gather_state(self, t: torch.Tensor) -> torch.Tensor:
        """(L, B, H) per rank -> (L, W*B, H) on every rank, ranks in order."""
        return t

    def scatter_state(self, t: torch.Tensor) -> torch.Tensor:
        """(L, W*B, H) -> this rank's (L, B, H)."""
        return t

    def consolidate_optimizer(self, optimizer) -> dict | None:
        """The full optimizer state_dict on rank 0 (None elsewhere)."""
        return optimizer.state_dict()

    def gather_object(self, obj) -> list:
        """[obj of rank 0, obj of rank 1, ...] on every rank."""
        return [obj]

    def broadcast_object(self, obj):
        """Rank 0's obj on every rank."""
        return obj

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class ProcessGroupParallel(Parallel):
    """A rank of a torch.distributed job: DDP, optional ZeRO-1, collectives on `device`."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str = "gloo"
    owns_group: bool = False  # setup() created the process group, so close() destroys it
    shards: list[int] | None = None  # optimizer-state elements per rank under ZeRO

    def describe(self) -> str:
        text = f"{self.world} processes ({self.backend}, DistributedDataParallel)"
        if not self.shards:
            return text
        total = sum(self.shards)
        largest = max(self.shards) / max(total, 1)
        text += (f"; ZeRO-1 optimizer state per rank: {' / '.join(f'{n:,}' for n in self.shards)} "
                 f"of {total:,} parameters")
        if largest > 1.25 / self.world:  # e.g. one rank holds > 62% of the state with 2 ranks
            text += (f" - saves little: the largest shard holds {largest:.0%} of it (ZeRO-1 keeps whole "
                     f"tensors together and an LSTM LM has a few large ones)")
        return text

    def wrap_model(self, model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def make_optimizer(self, cls: type, params, **kwargs) -> torch.optim.Optimizer:
        if not self.zero:
            return cls(params, **kwargs)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(list(params), optimizer_class=cls, **kwargs)
        mine = sum(p.numel() for g in opt.optim.param_groups for p in g["params"])
        self.shards = self.gather_object(mine)
        return opt

    def sum(self, values: list[float]) -> list[float]:
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(t)
        return t

    def gather_state(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t)
        return torch.cat(parts, dim=1)  # (L, W*B, H)

    def scatter_state(self, t: torch.Tensor) -> torch.Tensor:
        B = t.shape[1] // self.world
        return t[:, self.rank * B : (self.rank + 1) * B].contiguous()  # (L, B, H)

    def consolidate_optimizer(self, optimizer) -> dict | None:
        if hasattr(optimizer, "consolidate_state_dict"):  # ZeRO: a collective, every rank joins
            optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if self.is_main else None

    def gather_object(self, obj) -> list:
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj):
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        self.sum([0.0])  # a tiny all-reduce: works on every backend, under the same timeout

    def close(self) -> None:
        """Wait until rank 0 has written its last files, then leave the group (if setup made it)."""
        import torch.distributed as dist

        self.barrier()
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False


def setup(device: torch.device | None = None, zero: bool = False) -> Parallel:
    """A Parallel for this process (single process when not under torchrun).

    device: where the model lives; CUDA selects nccl (and this rank's GPU), CPU gloo.
    A process group that already exists (a test harness, an embedding program) is used
    as it is and left open by `close()`.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Parallel(zero=zero)
    import torch.distributed as dist

    if not dist.is_available():
        raise UsageError("this torch build has no torch.distributed; run a single process (no torchrun, no --nproc)")
    rank = int(os.environ["RANK"])
    device = device or torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    owns = not dist.is_initialized()
    if owns:
        timeout = collective_timeout()
        try:
            # torchrun's store outlives an elastic restart: keys of the failed attempt (peer
            # addresses) must not be read by the next one, hence one prefix per attempt.
            store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout)))
            store = dist.PrefixStore(f"zlm/attempt-{restart_count()}", store)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=timeout))
        except (RuntimeError, ValueError) as e:
            where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            raise ZlmError(
                f"rank {rank} could not join the {world}-process group at {where} within {timeout:.0f}s "
                f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); check that every rank "
                f"started and can reach MASTER_ADDR, or raise {TIMEOUT_ENV}"
            ) from None
    else:
        backend = dist.get_backend()
    if dist.get_world_size() != world or dist.get_rank() != rank:
        raise UsageError(f"the process group has {dist.get_world_size()} ranks but WORLD_SIZE is {world}")
    return ProcessGroupParallel(rank=rank, world=world, zero=zero, device=device,
                                backend=str(backend), owns_group=owns)
