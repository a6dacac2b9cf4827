"""Start or join the ranks of a tensor-parallel engine.

Rank 0 is the engine process (scheduler, sampler, server). The other ranks are either worker processes it
starts with torch.multiprocessing (one host), worker processes started by ``twophase … --node-rank K`` on
other hosts (``--nnodes``), or processes started by torchrun (``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` /
``MASTER_PORT`` in the environment). All meet at one TCP store on ``master_addr:master_port``; start-up waits
there while checking that the workers this process started are alive.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import pickle
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from twophase.config import ConfigError, EngineConfig, ModelConfig, ParallelConfig
from twophase.distributed.group import CONTROL_TIMEOUT, JOINED, TensorParallelGroup, wait_for_count
from twophase.distributed.sharding import check_size, plan_shards

log = logging.getLogger(__name__)
CONFIG = "twophase/tp/engine_config"


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where ranks live: ``world_size`` ranks, ``ranks_per_node`` per host, this host's ``node_rank``."""

    world_size: int
    ranks_per_node: int
    node_rank: int
    master_addr: str
    master_port: int
    from_env: bool  # torchrun started every rank: nobody spawns

    @property
    def local_ranks(self) -> range:
        """Global ranks on this host."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)


def topology(parallel: ParallelConfig) -> Topology:
    """The layout asked for by the options, or by a torchrun environment (which then must agree)."""
    size = parallel.tensor_parallel_size
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        world = int(os.environ["WORLD_SIZE"])
        if size not in (1, world):
            raise ConfigError(f"--tensor-parallel-size {size} differs from the launcher's WORLD_SIZE {world}")
        rank = int(os.environ["RANK"])
        return Topology(world, 1, rank, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                        int(os.environ.get("MASTER_PORT", "29500")), from_env=True)  # fmt: skip
    if parallel.nnodes < 1 or not 0 <= parallel.node_rank < parallel.nnodes:
        raise ConfigError(f"--node-rank must be in [0, --nnodes={parallel.nnodes}), got {parallel.node_rank}")
    if size % parallel.nnodes:
        raise ConfigError(f"--tensor-parallel-size {size} does not split over --nnodes {parallel.nnodes} hosts")
    if parallel.nnodes > 1 and not parallel.master_port:
        raise ConfigError("--nnodes > 1 needs --master-addr and --master-port (rank 0's host and a free port)")
    port = parallel.master_port or _free_port(parallel.master_addr)
    return Topology(size, size // parallel.nnodes, parallel.node_rank, parallel.master_addr, port, from_env=False)


def is_engine_process(parallel: ParallelConfig) -> bool:
    """False on a host or torchrun process that holds no rank 0 (it only serves worker ranks)."""
    return 0 in topology(parallel).local_ranks


def threads_per_rank(config: EngineConfig) -> int:
    """``--threads`` (per rank), or the physical cores shared by this host's ranks."""
    from twophase.engine import hardware

    if config.num_threads:
        return config.num_threads
    if config.parallel.tensor_parallel_size == 1:
        return hardware.physical_cores()
    return max(1, hardware.physical_cores() // topology(config.parallel).ranks_per_node)


def start_engine_rank(config: EngineConfig, model_config: ModelConfig) -> TensorParallelGroup | None:
    """Rank 0: refuse unsplittable shapes, start this host's other ranks, meet every rank. None without TP."""
    topo = topology(config.parallel)
    if topo.world_size == 1:
        return None
    check_size(model_config, topo.world_size)
    ctx = mp.get_context("spawn")
    processes = []
    if not topo.from_env:
        config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, master_port=topo.master_port))
        for rank in topo.local_ranks[1:]:
            process = ctx.Process(target=worker_main, args=(config, rank), name=f"tp-rank-{rank}", daemon=True)
            process.start()
            processes.append(process)
    try:
        store = _join(topo, 0, processes, config)
        group = TensorParallelGroup(plan_shards(model_config, 0, topo.world_size), _backend(config),
                                    config.parallel.timeout_s, store, processes)  # fmt: skip
    except BaseException:
        for process in processes:
            process.terminate()
        raise
    atexit.register(group.close)  # workers on other hosts are told to stop when this process exits
    return group


def _join(topo: Topology, rank: int, processes: list, config: EngineConfig | None = None) -> dist.TCPStore:
    """Connect to the store (rank 0 hosts it unless a launcher does, and publishes its ``config`` there: every
    rank runs the engine's dtype, weight format and cache shape); rank 0 waits until every rank is there."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(topo.master_addr, topo.master_port, topo.world_size, is_master=rank == 0 and not agent_store,
                          timeout=CONTROL_TIMEOUT, wait_for_workers=False)  # fmt: skip
    if config is not None:
        store.set(CONFIG, pickle.dumps(config))
    store.add(JOINED, 1)
    if rank == 0:
        wait_for_count(store, JOINED, topo.world_size, processes, "join")
    return store


def _backend(config: EngineConfig) -> str:
    return "nccl" if config.device.startswith("cuda") else "gloo"


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((addr, 0))
        return sock.getsockname()[1]


def worker_main(config: EngineConfig, rank: int) -> None:
    """One worker rank: join, load this rank's shard, serve rank 0's commands until told to stop."""
    from twophase.distributed.worker import worker_loop
    from twophase.engine.llm_engine import build_model_runner
    from twophase.loader import open_model_source

    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s")
    topo = topology(config.parallel)
    torch.set_num_threads(threads_per_rank(config))
    store = _join(topo, rank, [])
    engine_config = pickle.loads(store.get(CONFIG))  # rank 0's options; this host's threads and device
    config = dataclasses.replace(engine_config, num_threads=config.num_threads, device=config.device)
    source = open_model_source(config.model)
    group = TensorParallelGroup(plan_shards(source.config, rank, topo.world_size), _backend(config),
                                config.parallel.timeout_s, store)  # fmt: skip
    device = f"cuda:{rank % topo.ranks_per_node}" if config.device.startswith("cuda") else config.device
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    runner = build_model_runner(dataclasses.replace(config, device=device), source, group, progress=False)
    try:
        worker_loop(runner)
    except RuntimeError as exc:  # rank 0 went away: nothing left to serve
        log.warning("rank %d stopping: %s", rank, str(exc).splitlines()[0] if str(exc) else exc)
    finally:
        group.closed = True


def run_worker_host(config: EngineConfig) -> int:
    """A host (or torchrun process) without rank 0: run its ranks until rank 0 stops them; the exit status."""
    topo = topology(config.parallel)
    if topo.from_env:
        worker_main(config, topo.node_rank)
        return 0
    ctx = mp.get_context("spawn")
    processes = [ctx.Process(target=worker_main, args=(config, r), name=f"tp-rank-{r}") for r in topo.local_ranks]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    failed = [p for p in processes if p.exitcode]
    for process in failed:
        print(f"twophase: error: tensor-parallel worker {process.name} exited with code {process.exitcode}", file=sys.stderr)
    return 1 if failed else 0
