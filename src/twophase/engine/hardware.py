"""What the machine offers the engine: physical cores, bfloat16 support, memory left for the KV cache.

Read once at engine start-up; nothing here is cached in process-global state.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

KV_CACHE_MEMORY_FRACTION = 0.4  # of the memory still available after the weights are loaded (CPU)
KV_CACHE_GPU_FRACTION = 0.8  # of the free device memory (CUDA)


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_flags() -> set[str]:
    """ISA flags of the first CPU in /proc/cpuinfo (empty where there is none)."""
    for line in _cpuinfo().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX-BF16)."""
    flags = cpu_flags()
    if flags:
        return bool(flags & {"avx512_bf16", "amx_bf16"})
    probe = getattr(torch._C, "_cpu", None)  # non-Linux: ask torch
    return bool(probe and getattr(probe, "_is_avx512_bf16_supported", lambda: False)())


def cpu_has_amx() -> bool:
    """True when the CPU has AMX tiles for bfloat16 (where torch's CPU flash attention runs its products on them)."""
    return "amx_bf16" in cpu_flags()


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads counted once)."""
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cores, core = set(), {}
    for line in _cpuinfo().splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key in ("physical id", "core id"):
            core[key] = value
        elif not line.strip() and core:
            cores.add((core.get("physical id"), core.get("core id")))
            core = {}
    if core:
        cores.add((core.get("physical id"), core.get("core id")))
    return max(1, min(allowed, len(cores) or allowed))


def available_memory() -> int:
    """Bytes of RAM still available (MemAvailable), or a conservative 4 GiB where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def kv_cache_budget(device: torch.device) -> int:
    """Bytes the KV cache may take by default: a fraction of what is free once the weights are in memory."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * KV_CACHE_GPU_FRACTION)
    return int(available_memory() * KV_CACHE_MEMORY_FRACTION)
