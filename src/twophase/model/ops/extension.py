"""Builds and loads the twophase C++ CPU kernels; ``None`` when they cannot be built (callers use plain torch).

The extension is compiled once per (sources, torch version, flags, CPU) into
``$TWOPHASE_HOME/extensions/<name>-<hash>/``; later processes import the finished ``.so`` directly
(tens of milliseconds), without running the compiler or ninja. ``TWOPHASE_NO_KERNELS=1`` disables it.

Kernels (all CPU, OpenMP over torch's intra-op threads, AVX2/FMA with a scalar fallback):

- ``panel_shape(n, k)``: [ceil(N/24), K, 24], the column panels (k-major) that ``linear.pack_panels`` makes of a fp32,
  bf16 or int8 weight [N,K]; ``panel_linear(x, panels, n, bias=None, batch_invariant=False, scale=None)``: x fp32
  [M,K] -> fp32 [M,N] = (x @ w.T) * scale + bias at any M (scale fp32 [N]: int8 only). ``batch_invariant``: one
  summation order per row at every M (else M = 1 takes a faster order of its own).
- ``linear_q8_0(x, qs, d, bias=None)`` (batch-invariant at every M): qs int8 [N,K], d fp16 [N,K/32]; w = d * q (layouts: ``quant.py``); x is
  rounded to int8 blocks of 32 first (``quant.quantize_activations``), so block dot products are integer.
- ``linear_q4_1(x, qs, d, m, bias=None)``: qs uint8 [N,K/2] (GGUF nibble order), d, m fp16 [N,K/32]; w = d*q + m;
  x rounded as for Q8_0.
- ``paged_attention(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_size, scale)``:
  writes ``out`` [T,H,D] (contiguous; q's dtype, or bfloat16 beside float32 queries: the float32 result rounded
  once); q [T,H,D] may have rows further apart (a view of a fused QKV projection), its heads
  contiguous within a token; see ``reference_paged_attention`` in ``model/attention.py`` (the oracle).
- fused layer ops (``csrc/fused.cpp``; float32 / bfloat16, rounding as the eager torch code they replace):
  ``rms_norm(x, weight, eps, bf16_out=False)``, ``add_rms_norm_(x, residual, weight, eps, out=None)`` (residual +=
  x; x = norm(residual); a float32 x's norm rounded once to bfloat16 where asked, for a GEMM that would round it),
  ``silu_and_mul(gate_up)``, ``rotary_cache_(qkv, positions, cos, sin, k_cache, v_cache, slots, heads, kv_heads)``
  (rotate q/k heads in place from the float32 cos / signed-sin tables, store k/v rows at their cache slots).
- ``bf16_gemm_available()``, ``pack_bf16_gemm(weight)``, ``bf16_gemm(x, packed, n, bf16_out)`` (``csrc/gemm_bf16.cpp``,
  where the CPU has AVX512-BF16): y = x @ w.T for a bfloat16 w [N, K] (K even) in panels of 32 outputs with k in
  pairs, x float32 / bfloat16 [M, K] rounded to bfloat16, float32 sums on ``vdpbf16ps``, the result rounded to
  bfloat16 (``bf16_out``) or those values as float32; written for 8-127 rows.
- ``int8_gemm_available()``, ``pack_int8_gemm(values, scales, mins=None)``, ``int8_gemm(x, packed, negsum, scales,
  mins, n)`` (``csrc/gemm_int8.cpp``, where the CPU has AVX512-VNNI): y = x @ w.T for w in int8 blocks of 32 (values
  int8 [N, K], scales / mins float32 [N, K/32]; Q8_0 / Q4_1), x float32 [M, K] rounded to int8 blocks as for Q8_0,
  each block's products summed exactly on ``vpdpbusd``; any M, a row's result independent of the others.
- ``LinearOp(kind, tensors, bias=None, batch_invariant=False, out_features=0)``: one packed projection
  (``panels`` / ``int8`` (panels, scale), both with their ``out_features`` / ``q8_0`` / ``q4_1``) over the linear
  kernels above; ``set_gemm_weight`` / ``set_dot_weight`` give it torch's or ``bf16_gemm``'s GEMM for many rows
  (``gemm.py``), ``set_int8_gemm`` a block format ``int8_gemm`` (``linear.QuantizedLinear``); the Python linear layers and the decoder stack both call it.
- ``DecoderStack`` / ``StackLayer`` (``csrc/stack.cpp``): every decoder layer in one call, the kernels above in the
  order of ``model/llama.py``'s loop (see ``ops/stack.py``).
- ``pack_block_panels_(out, fmt, packed)`` / ``block_panels_equal(panels, weight)``: GGUF Q8_0 / Q4_1 blocks into
  the block panels ``linear.BlockPanelLinear`` runs, and whether they widen to exactly a float32 weight.
- ``top_p_mask_(logits, top_p)`` (``csrc/sampling.cpp``): in place, -inf outside each row's top-p set, found by
  selection instead of a sort (``sample/top_k_top_p.py``); ``argmax_rows(logits)``: each row's first maximum, the
  greedy rows' tokens (``sample/sampler.py``).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from twophase.loader.store import store_home

log = logging.getLogger(__name__)

NAME = "twophase_kernels"
DISABLE_ENV = "TWOPHASE_NO_KERNELS"
CSRC = Path(__file__).with_name("csrc")
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG"]
LDFLAGS = ["-fopenmp"]
_DONE = "BUILD_OK"  # marker written after a successful build; its absence means "build (again)"


def _sources() -> list[Path]:
    """The .cpp files compiled into the extension (headers are hashed, not compiled)."""
    return sorted(CSRC.glob("*.cpp"))


def _cpu_signature() -> str:
    """Model name and ISA flags of this CPU: ``-march=native`` binaries must not move between CPUs."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(keep))  # first of each distinct line


@functools.lru_cache(maxsize=1)
def build_key() -> str:
    """Short hash of the sources, headers, torch version, Python ABI, flags and CPU."""
    h = hashlib.sha256()
    for path in sorted(CSRC.glob("*")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    for part in (torch.__version__, sys.version, " ".join(CFLAGS + LDFLAGS), _cpu_signature()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:12]


def build_dir() -> Path:
    """``$TWOPHASE_HOME/extensions/<name>-<hash>``."""
    return store_home() / "extensions" / f"{NAME}-{build_key()}"


def _is_built(directory: Path) -> bool:
    """Whether ``directory`` holds a finished build (its marker and the shared object)."""
    return (directory / _DONE).exists() and (directory / f"{NAME}.so").exists()


def _import_built(directory: Path) -> ModuleType | None:
    """Imports an already-built extension from ``directory``, or ``None`` when there is none."""
    if not _is_built(directory):
        return None
    spec = importlib.util.spec_from_file_location(NAME, directory / f"{NAME}.so")
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ninja_dirs() -> list[str]:
    """Where the pip ``ninja`` package and this interpreter's scripts live (a venv need not be activated)."""
    dirs = [str(Path(sys.executable).parent)]
    try:
        import ninja

        dirs.insert(0, str(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    return dirs


def _compile(directory: Path, verbose: bool = False) -> ModuleType:
    """Compiles the sources with torch's cpp_extension (ninja) into ``directory``."""
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.flock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # one builder at a time; released if the process dies
        module = _import_built(directory)  # another process may have finished while we waited
        if module is not None:
            return module
        (directory / "lock").unlink(missing_ok=True)  # cpp_extension's baton, stale after a killed build
        old_path = os.environ.get("PATH", "")
        os.environ["PATH"] = os.pathsep.join([*_ninja_dirs(), old_path])  # cpp_extension runs `ninja`
        try:
            module = cpp_extension.load(
                name=NAME,
                sources=[str(s) for s in _sources()],
                extra_cflags=CFLAGS,
                extra_ldflags=LDFLAGS,
                extra_include_paths=[str(CSRC)],
                build_directory=str(directory),
                verbose=verbose,
            )
        finally:
            os.environ["PATH"] = old_path
        (directory / _DONE).write_text(torch.__version__ + "\n")
    return module


def build_kernels(verbose: bool = False) -> Path:
    """Builds (or reuses) the extension and returns its build directory; raises when the build fails."""
    directory = build_dir()
    if _import_built(directory) is None:
        _compile(directory, verbose=verbose)
    return directory


@functools.lru_cache(maxsize=1)
def load_kernels() -> ModuleType | None:
    """The compiled kernels module (built on first use), or ``None`` if disabled or the build fails."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None
    try:
        directory = build_dir()
        return _import_built(directory) or _compile(directory)
    except Exception as exc:  # noqa: BLE001 - any build failure means "fall back to torch"
        log.warning("twophase C++ kernels unavailable (%s: %s); using plain torch", type(exc).__name__, exc)
        return None


def built_kernels() -> ModuleType | None:
    """The kernels module when it is already built, else ``None``: never compiles (for optional speed-ups such as
    loading, which must not wait minutes for a build that the model runner may not want)."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None
    return load_kernels() if _is_built(build_dir()) else None


def kernels_available() -> bool:
    """Whether ``load_kernels()`` gives a module."""
    return load_kernels() is not None


def main() -> None:
    """``python -m twophase.model.ops.extension``: build the kernels and print where they live."""
    t0 = time.perf_counter()
    directory = build_kernels(verbose="-v" in sys.argv)
    print(f"twophase kernels: {directory} ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
