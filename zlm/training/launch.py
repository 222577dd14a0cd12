"""`zlm train --nproc N`: N local training processes under torch's elastic agent.

This is the machinery torchrun uses (`torch.distributed.launcher.api.elastic_launch`
with a standalone c10d rendezvous on localhost), not a process pool of our own: the agent
starts N workers with RANK, LOCAL_RANK, WORLD_SIZE and MASTER_ADDR/PORT set, watches them,
and stops every worker as soon as one fails. `zlm.training.distributed` then sees exactly the
environment torchrun would have given it.

It knows nothing of training: `zlm.training.runner` plans the run (checks, prepares and
resolves once, before any worker starts) and hands `run_local` its worker function. Each
worker runs in a session of its own: Ctrl-C or SIGTERM reaches the agent alone, which forwards it to every
worker once, so the workers save a checkpoint together and exit cleanly.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable
from typing import Any

from zlm.errors import ZlmError

SHUTDOWN_GRACE = 60  # seconds the workers get to save a checkpoint after Ctrl-C/SIGTERM


class WorkersFailed(ZlmError):
    """A worker process failed; the agent stopped the others. Carries the worker's exit code."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def run_local(fn: Callable, args: tuple, nproc: int, *, max_restarts: int = 0,
              shutdown_timeout: int | None = None) -> dict[int, Any]:
    """Run `fn(*args)` in `nproc` worker processes on this machine; {rank: return value}.

    fn must be importable by name (the workers are spawned). Raises WorkersFailed naming
    every failed rank, or Interrupted when the launcher got a signal (after forwarding it
    to the workers and giving them `shutdown_timeout` seconds to stop). max_restarts:
    relaunch all workers this often after a failure (TORCHELASTIC_RESTART_COUNT tells them
    which attempt they are).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun: share the cores among the workers
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    if shutdown_timeout is None:
        shutdown_timeout = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_GRACE))
    # The agent's per-worker error files live in a folder removed when the job ends (by
    # default torch leaves a /tmp/torchelastic_* folder behind for every launch), and so
    # does every temporary file this process makes while the job runs: torch's spawn names
    # a pytorch-errorfile-*.pickle per worker in the temp folder and leaves it where a
    # worker failed.
    logs = tempfile.TemporaryDirectory(prefix="zlm-launch-")
    temp_before, tempfile.tempdir = tempfile.tempdir, logs.name
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"zlm-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts,
        monitor_interval=0.1, start_method="spawn", shutdown_timeout=shutdown_timeout,
        logs_specs=DefaultLogsSpecs(log_dir=logs.name),
    )
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    saved = {sig: signal.getsignal(sig) for sig in handled}  # the agent installs its own
    try:
        return elastic_launch(config, _worker)(fn, *args)
    except ChildFailedError as e:
        raise WorkersFailed(*_describe_failures(e, nproc)) from None
    except SignalException as e:
        raise Interrupted(e.sigval) from None
    finally:
        tempfile.tempdir = temp_before
        logs.cleanup()
        if threading.current_thread() is threading.main_thread():
            for sig, handler in saved.items():
                if handler is not None:
                    signal.signal(sig, handler)


class Interrupted(ZlmError):
    """The launcher got Ctrl-C or SIGTERM and the workers were told to save and stop."""

    def __init__(self, sig: int):
        self.signal = signal.Signals(sig)
        super().__init__(f"interrupted by {self.signal.name}")
        self.exit_code = 128 + int(sig)


def _describe_failures(e, nproc: int) -> tuple[str, int]:
    """ChildFailedError -> (one line naming every failed rank, the exit code to return)."""
    parts, code = [], None
    for rank, f in sorted(e.failures.items()):
        if f.exitcode < 0:
            parts.append(f"rank {rank} was killed by {f.signal_name()}")
            code = code or 1
        else:
            msg = f.message.get("message", "") if isinstance(f.message, dict) else str(f.message)
            why = "" if not msg or msg.startswith("To enable traceback") else f" ({msg.splitlines()[0]})"
            parts.append(f"rank {rank} exited with code {f.exitcode}{why}")
            code = code or f.exitcode
    text = "; ".join(parts) + f"; all {nproc} processes were stopped"
    return text, code or 1


def _worker(fn: Callable, *args):
    """Runs in each worker: own session, cores shared out, errors as one line and an exit code."""
    import torch

    os.setsid()  # signals for the job reach the agent, which forwards them once
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        torch.set_num_threads(int(threads))
    rank = int(os.environ.get("RANK", "0"))
    try:
        return fn(*args)
    except ZlmError as e:
        print(f"error: rank {rank}: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    except torch.distributed.DistError as e:  # a peer died or timed out: say so in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: rank {rank} lost contact with the other processes ({first})", file=sys.stderr, flush=True)
        sys.exit(1)
