"""Weights and the KV cache in memory that Linux backs with 2 MiB pages (transparent huge pages, ``madvise``).

A decode step streams every weight byte once and reads the KV cache a block of slots at a time at scattered
addresses. With 4 KiB pages that is a TLB entry (and, past the TLB's reach, a page walk) per 4 KiB; with 2 MiB
pages, one per 2 MiB. Measured on a 2-core Zen 3 (THP in ``madvise`` mode, the common default; ``docs/runs/
compare-cpu/README.md``): our float32 kernel over SmolLM2-135M's 121 weight matrices at one row 3-11% less time,
paged decode attention over 30 layers' caches 6-9% less, batch-1 decode in the engine +26% and +7% (two A/Bs);
start-up pays for copying the weights in once (+0.5-0.9 s on that VM).

Tensors are carved out of large chunks (a bump allocator), each chunk aligned to 2 MiB and advised
``MADV_HUGEPAGE`` before its pages are first touched, so no tensor pads to a page of its own. A chunk lives as long
as any tensor cut from it. Where ``madvise`` is missing (not Linux), the device is not a CPU, a tensor is small, or
``TWOPHASE_HUGE_PAGES=0`` is set, allocation is plain ``torch.empty`` and nothing else changes.

The KV cache is allocated untouched (no start-up time), so its pages are mapped when a step first writes them: on
the 2-core VM, 1.0 s per GiB of fresh huge pages (0.39 s in 4 KiB pages; 0.07 s to write the same GiB once
mapped). ``Prefaulter`` maps them ahead, a slice per call, without writing them (``MADV_POPULATE_WRITE``): the
served engine calls it while it has nothing to run (``LLMEngine.idle_work``), so requests after an idle start find
their blocks' pages mapped.
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
MADV_POPULATE_WRITE = 23  # Linux 5.14+: map pages as a write would, leaving their contents alone
PAGE = 4096
HUGE_PAGE = 2 << 20
CHUNK_BYTES = 64 << 20  # a tensor larger than this gets a chunk of its own size
MIN_BYTES = 64 << 10  # smaller tensors (norms, biases, small scale tables) stay where they are; a Q4_1 576 x 576
# projection's block panels (207 KB) are streamed every step like the rest
ALIGN = 64  # bytes: a cache line, what torch's CPU allocator gives too


def _madvise():
    """libc's ``madvise`` for huge pages, or None where there is none to call or ``TWOPHASE_HUGE_PAGES=0``."""
    if os.environ.get("TWOPHASE_HUGE_PAGES", "1") == "0":
        return None
    return _libc_madvise()


def _libc_madvise():
    """libc's ``madvise`` (argument types set), or None where there is none to call (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


class HugePageArena:
    """Bump allocator over ``MADV_HUGEPAGE``-advised chunks of CPU memory."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self.madvise = _madvise()
        self.chunk: torch.Tensor | None = None  # uint8 [n], 2 MiB-aligned start; the one being carved
        self.offset = 0  # bytes of ``chunk`` handed out
        self.ranges: list[tuple[int, int]] = []  # [start, end) addresses of every chunk made (``holds``)

    @property
    def enabled(self) -> bool:
        """Whether tensors get huge pages here (``madvise`` callable and not switched off)."""
        return self.madvise is not None

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor, in huge-page memory when enabled and at least ``MIN_BYTES``."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if not self.enabled or nbytes < MIN_BYTES:
            return torch.empty(shape, dtype=dtype)
        if self.chunk is None or self.offset + nbytes > self.chunk.numel():
            self._new_chunk(max(self.chunk_bytes, nbytes))
        start = self.offset
        self.offset = -(-(start + nbytes) // ALIGN) * ALIGN
        return self.chunk[start : start + nbytes].view(dtype).view(shape)

    def adopt(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` moved into huge-page memory (a contiguous copy); ``t`` itself when it stays (not a CPU tensor,
        small, disabled, or already in this arena)."""
        if t.device.type != "cpu" or not self.enabled or t.nbytes < MIN_BYTES or self.holds(t):
            return t
        return self.empty(tuple(t.shape), t.dtype).copy_(t)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s data lies in a chunk of this arena (or where one was: a chunk freed and its addresses
        reused only leaves a tensor where it is)."""
        p = t.data_ptr()
        return any(lo <= p < hi for lo, hi in self.ranges)

    def _new_chunk(self, nbytes: int) -> None:
        nbytes = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # untouched: no page is mapped yet
        skip = -raw.data_ptr() % HUGE_PAGE
        chunk = raw[skip : skip + nbytes]
        if self.madvise(chunk.data_ptr(), nbytes, MADV_HUGEPAGE) != 0:  # e.g. a kernel built without THP
            self.madvise = None
        self.chunk, self.offset = chunk, 0
        self.ranges.append((chunk.data_ptr(), chunk.data_ptr() + nbytes))


class Prefaulter:
    """Maps the pages of untouched CPU tensors ahead of their first write, ``step_bytes`` per ``step()``, without
    changing a byte (``MADV_POPULATE_WRITE``), so it may run while the tensors are in use.

    The tensors are walked offset-major: the first 2 MiB of each, then the next 2 MiB of each, and so on — a KV
    cache's layers in the order its blocks are handed out (block 0 first). A kernel without the advice (before Linux
    5.14), or any other failure, ends the walk: pages are then mapped by their first write, as without it.
    """

    def __init__(self, tensors: list[torch.Tensor], step_bytes: int = 16 << 20) -> None:
        self.madvise = _libc_madvise()
        ranges = [(t.data_ptr(), t.nbytes) for t in tensors if t.device.type == "cpu" and t.nbytes > 0]
        self.step_bytes = max(HUGE_PAGE, step_bytes)
        self.slices = self._slices(ranges)  # (address, bytes) still to map, in order
        self.next = next(self.slices, None)

    @staticmethod
    def _slices(ranges: list[tuple[int, int]]):
        """Every tensor's 2 MiB slices, offset-major: the first 2 MiB of each tensor, then the next of each, ..."""
        longest = max((n for _, n in ranges), default=0)
        for offset in range(0, longest, HUGE_PAGE):
            for start, nbytes in ranges:
                if offset < nbytes:
                    yield start + offset, min(HUGE_PAGE, nbytes - offset)

    @property
    def done(self) -> bool:
        """Whether nothing is left to map (or mapping ahead is not possible here)."""
        return self.madvise is None or self.next is None

    def step(self) -> bool:
        """Map up to ``step_bytes`` more (2 MiB slices); False when there was nothing to do."""
        if self.done:
            return False
        mapped = 0
        while mapped < self.step_bytes and not self.done:
            mapped += self._populate(*self.next)
            self.next = next(self.slices, None)
        return True

    def _populate(self, address: int, nbytes: int) -> int:
        lo, hi = address // PAGE * PAGE, -(-(address + nbytes) // PAGE) * PAGE  # whole pages, all mapped already
        if self.madvise(lo, hi - lo, MADV_POPULATE_WRITE) != 0:  # step() calls it only while madvise is set
            self.madvise = None  # unsupported here: first writes map the rest
        return hi - lo


_ARENA: HugePageArena | None = None


def arena() -> HugePageArena:
    """The process's arena (made on first use; it keeps only the chunk being carved, plus the address ranges)."""
    global _ARENA
    if _ARENA is None:
        _ARENA = HugePageArena()
    return _ARENA
