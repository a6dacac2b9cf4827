"""The process groups of one tensor-parallel engine and every collective the model and the runner call.

Two process groups over the same ranks, made from the TCP store the ranks met at (plain objects: no
``init_process_group``, so several engines may live in one process, e.g. in tests):

- the *control* group (gloo, no practical timeout on the workers' side): rank 0 broadcasts each step's command,
  which the workers may wait for as long as the engine is idle (rank 0's sends are bounded by ``timeout_s``);
- the *compute* group (``timeout_s``): the all-reduces and the logits gather inside a forward. A worker that
  died makes them fail at once (connection closed); one that hangs makes them fail after ``timeout_s``.

On rank 0 every failure surfaces as ``TensorParallelError`` naming the ranks and processes involved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import pickle
import threading
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from twophase.distributed.sharding import ShardPlan

CONTROL_TIMEOUT = datetime.timedelta(days=365)
STARTUP_TIMEOUT_S = 600.0
JOINED, LOADED, NUM_BLOCKS = "twophase/tp/joined", "twophase/tp/loaded", "twophase/tp/num_blocks"


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker died, hung past the timeout, or failed; the engine cannot continue."""


@dataclasses.dataclass
class CollectiveStats:
    """All-reduce count and seconds spent in them on this rank (for the benchmark)."""

    num_all_reduces: int = 0
    all_reduce_seconds: float = 0.0

    def snapshot(self) -> CollectiveStats:
        """A copy of the counters now (to subtract from later ones)."""
        return dataclasses.replace(self)

    def per_step(self, before: CollectiveStats, steps: int) -> dict[str, float]:
        """All-reduces and milliseconds spent in them per step since ``before``, over ``steps`` steps
        (the benchmarks' JSON keys)."""
        steps = max(steps, 1)
        return {
            "all_reduces_per_step": (self.num_all_reduces - before.num_all_reduces) / steps,
            "all_reduce_ms_per_step": 1000 * (self.all_reduce_seconds - before.all_reduce_seconds) / steps,
        }


class TensorParallelGroup:
    """One rank's view: its shard plan, the collectives, and (rank 0) the step broadcast and the workers."""

    def __init__(self, plan: ShardPlan, backend: str, timeout_s: float, store, processes: list | None = None) -> None:
        """Connect this rank's two groups through ``store`` (every rank constructs them in the same order)."""
        self.plan = plan
        self.rank = plan.rank
        self.size = plan.size
        self.backend = backend
        self.timeout_s = timeout_s
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.control_group = _process_group("gloo", dist.PrefixStore("control/", store), plan, CONTROL_TIMEOUT)
        self.compute_group = _process_group(backend, dist.PrefixStore("compute/", store), plan, self.timeout)
        self.processes = processes or []  # worker processes this process started (rank 0 / a worker host)
        self.store = store  # the TCP store every rank met at (start-up agreements)
        self.stats = CollectiveStats()
        self.closed = False

    # ---- collectives inside the forward (same calls, same order on every rank) -------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks (in place when possible); gloo reduces half precisions in float32."""
        start = time.perf_counter()
        if self.backend == "gloo" and x.dtype in (torch.bfloat16, torch.float16):
            wide = x.float()
            self.compute_group.allreduce([wide]).wait()
            x = wide.to(x.dtype)
        else:
            self.compute_group.allreduce([x]).wait()
        self.stats.num_all_reduces += 1
        self.stats.all_reduce_seconds += time.perf_counter() - start
        return x

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """local logits [N, own vocab] → [N, vocab] on rank 0 (other ranks get their input back)."""
        counts = self.plan.vocab_counts
        padded = torch.nn.functional.pad(local, (0, max(counts) - local.shape[1])).contiguous()  # [N, max count]
        parts = [torch.empty_like(padded) for _ in counts] if self.rank == 0 else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self.compute_group.gather([parts] if parts else [], [padded], options).wait()
        if self.rank != 0:
            return local
        return torch.cat([p[:, :c] for p, c in zip(parts, counts)], dim=1)

    # ---- the step command (control group) ---------------------------------------------------------
    def broadcast_command(self, kind: str, payload: Any = None) -> None:
        """Rank 0: send the next command to every worker (they run the same forward); a worker that does not
        take it within the timeout (hung) fails the step."""
        self.check_workers()
        data = torch.frombuffer(bytearray(pickle.dumps((kind, payload))), dtype=torch.uint8)  # [n]
        with self.failures():
            for tensor in (torch.tensor([data.numel()], dtype=torch.int64), data):
                self.control_group.broadcast([tensor], _root()).wait(self.timeout)

    def receive_command(self) -> tuple[str, Any]:
        """Workers: block (without timeout: the engine may idle) until rank 0 sends a command."""
        size = torch.empty(1, dtype=torch.int64)
        self.control_group.broadcast([size], _root()).wait()
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.control_group.broadcast([data], _root()).wait()
        return pickle.loads(data.numpy().tobytes())

    def agree(self, value: int) -> int:
        """Every rank gets rank 0's ``value`` once all have loaded (the number of KV blocks: the same block ids
        everywhere). Rank 0 waits while checking that its workers are alive (a failed load is reported)."""
        if self.rank != 0:
            self.store.add(LOADED, 1)
            return int(self.store.get(NUM_BLOCKS))
        wait_for_count(self.store, LOADED, self.size - 1, self.processes, "load its shard")
        self.store.set(NUM_BLOCKS, str(value))
        return value

    # ---- failures ----------------------------------------------------------------------------------
    def check_workers(self) -> None:
        """Raise TensorParallelError when a worker process this process started has exited."""
        for process in self.processes:
            if not process.is_alive():
                raise TensorParallelError(
                    f"tensor-parallel worker {process.name} (pid {process.pid}) exited with code {process.exitcode}; "
                    "the engine stopped"
                )

    @contextlib.contextmanager
    def failures(self) -> Iterator[None]:
        """Turn a failed or timed-out collective into TensorParallelError (the engine cannot go on)."""
        try:
            yield
        except TensorParallelError:
            raise
        except RuntimeError as exc:
            self.check_workers()
            raise TensorParallelError(
                f"tensor-parallel collective failed ({self.size} ranks, timeout {self.timeout_s:g}s): "
                f"a worker died or hung: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            ) from exc

    @contextlib.contextmanager
    def step(self, kind: str, payload: Any) -> Iterator[None]:
        """Rank 0: broadcast a command, then run its forward with failures reported clearly."""
        self.broadcast_command(kind, payload)
        with self.failures():
            yield

    def watch(self, on_failure: Callable[[TensorParallelError], None], interval_s: float = 0.5) -> None:
        """Start a daemon thread calling ``on_failure`` once if a worker process exits (an idle engine learns
        it too: the server turns unhealthy without waiting for the next request)."""

        def run() -> None:
            while not self.closed:
                try:
                    self.check_workers()
                except TensorParallelError as exc:
                    on_failure(exc)
                    return
                time.sleep(interval_s)

        threading.Thread(target=run, name="twophase-tp-watchdog", daemon=True).start()

    def close(self, join_timeout_s: float = 10.0) -> None:
        """Rank 0: tell the workers to stop and wait for the processes this one started."""
        if self.closed:
            return
        self.closed = True
        if self.rank == 0:
            with contextlib.suppress(Exception):
                if all(p.is_alive() for p in self.processes):
                    self.broadcast_command("stop")
        for process in self.processes:
            process.join(join_timeout_s)
            if process.is_alive():
                process.terminate()


def _root() -> dist.BroadcastOptions:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return options


def _process_group(backend: str, store, plan: ShardPlan, timeout: datetime.timedelta):
    """A gloo or NCCL process group object over every rank (not registered as torch's default group)."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, plan.rank, plan.size, options)
    return dist.ProcessGroupGloo(store, plan.rank, plan.size, timeout)


def wait_for_count(store, key: str, target: int, processes: list, what: str) -> None:
    """Poll a store counter until it reaches ``target``, failing fast when a started worker exits."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while store.add(key, 0) < target:
        for process in processes:
            if not process.is_alive():
                raise TensorParallelError(f"tensor-parallel worker {process.name} exited with code "
                                          f"{process.exitcode} before it could {what}")  # fmt: skip
        if time.monotonic() > deadline:
            raise TensorParallelError(f"tensor-parallel ranks did not {what} within {STARTUP_TIMEOUT_S:g}s "
                                      f"({store.add(key, 0)} of {target})")  # fmt: skip
        time.sleep(0.02)
