"""Huge-page memory for weights and the KV cache (model/ops/huge_pages.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from twophase.model.ops.huge_pages import ALIGN, HUGE_PAGE, MIN_BYTES, PAGE, HugePageArena, Prefaulter

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.path.isdir("/sys/kernel/mm/transparent_hugepage"),
    reason="needs Linux with transparent huge pages (madvise is Linux's)",
)


def _resident_pages(t: torch.Tensor) -> int:
    """How many of ``t``'s 4 KiB pages are mapped (libc ``mincore``); ``t`` starts on a page."""
    import ctypes

    assert t.data_ptr() % PAGE == 0
    n = -(-t.nbytes // PAGE)
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(t.nbytes), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec)


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping holding ``address`` (this process's /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    return set()


@linux_only
def test_tensors_are_carved_from_advised_aligned_chunks() -> None:
    arena = HugePageArena(chunk_bytes=8 << 20)
    assert arena.enabled
    a = arena.empty((1000, 577), torch.float32)  # 2.3 MB, not a multiple of the alignment
    b = arena.empty((300, 1000), torch.int8)
    assert a.shape == (1000, 577) and a.dtype == torch.float32 and a.is_contiguous()
    assert arena.holds(a) and arena.holds(b)
    assert a.data_ptr() % HUGE_PAGE == 0  # the first tensor starts the chunk
    assert b.data_ptr() % ALIGN == 0 and b.data_ptr() >= a.data_ptr() + a.nbytes  # next, not overlapping
    a.fill_(1.0), b.fill_(2)
    assert a.sum().item() == 1000 * 577 and b.sum().item() == 2 * 300 * 1000  # neither wrote over the other
    assert "hg" in _vm_flags(a.data_ptr())  # the chunk is advised MADV_HUGEPAGE


@linux_only
def test_large_tensors_get_a_chunk_of_their_own_and_small_ones_stay_plain() -> None:
    arena = HugePageArena(chunk_bytes=4 << 20)
    big = arena.empty((3 << 20,), torch.float32)  # 12 MiB > the chunk size
    assert arena.holds(big) and len(arena.ranges) == 1
    small = arena.empty((MIN_BYTES // 4 - 1,), torch.float32)
    assert not arena.holds(small)


@linux_only
def test_adopt_copies_once_and_keeps_values() -> None:
    arena = HugePageArena()
    w = torch.randn(576, 1536)
    moved = arena.adopt(w)
    assert moved.data_ptr() != w.data_ptr() and torch.equal(moved, w) and arena.holds(moved)
    assert arena.adopt(moved) is moved  # already there: no second copy
    small = torch.randn(576)
    assert arena.adopt(small) is small


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TWOPHASE_HUGE_PAGES", "0")
    arena = HugePageArena()
    assert not arena.enabled
    w = torch.randn(576, 1536)
    assert arena.adopt(w) is w and not arena.holds(arena.empty((1 << 20,), torch.float32))


@linux_only
def test_the_default_model_streams_its_weights_and_cache_from_huge_pages(default_model) -> None:
    """Every projection's panels (float32 run from the file's Q4_1 / Q8_0 blocks), the tied head's and the KV cache
    of the engine's float32 default lie in the process arena."""
    from twophase import LLM
    from twophase.model.ops.huge_pages import arena
    from twophase.model.ops.linear import PanelLinear

    llm = LLM(str(default_model), progress=False, num_blocks=64)
    model = llm.engine.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, PanelLinear)]
    assert len(layers) == 4 * model.config.num_hidden_layers + 1  # qkv, o, gate_up, down; the head
    assert all(arena().holds(m.panels) for m in layers)
    k, v = llm.engine.model_runner.kv_caches[0]
    assert arena().holds(k) and arena().holds(v)


@linux_only
def test_prefaulter_maps_pages_ahead_without_changing_them() -> None:
    """Offset-major: a 2 MiB step maps the first 2 MiB of the first tensor only; walked to the end, every page of
    both tensors is mapped and the bytes written before (and the zeros never written) are what they were."""
    import mmap

    maps = [mmap.mmap(-1, 6 << 20) for _ in range(2)]  # fresh anonymous memory: no page mapped yet
    k, v = (torch.frombuffer(m, dtype=torch.uint8) for m in maps)
    assert _resident_pages(k) == 0 and _resident_pages(v) == 0
    k[: 3 << 20].fill_(7)  # written before: the first two huge pages (of three)
    pre = Prefaulter([k, v], step_bytes=HUGE_PAGE)
    if pre.done:
        pytest.skip("no MADV_POPULATE_WRITE here (Linux < 5.14)")
    assert pre.step()
    if pre.done:
        pytest.skip("MADV_POPULATE_WRITE refused here")
    assert _resident_pages(v) == 0  # k's first 2 MiB came first
    while pre.step():
        pass
    assert pre.done and not pre.step()
    assert _resident_pages(k) == k.nbytes // PAGE and _resident_pages(v) == v.nbytes // PAGE
    assert int(k[: 3 << 20].sum()) == 7 * (3 << 20) and int(k[3 << 20 :].sum()) == 0 and int(v.sum()) == 0
    del k, v
