"""Analytic cost of a step (FLOPs, bytes, arithmetic intensity), this machine's ceilings, and the roofline plot.

The byte accounting follows one rule everywhere: a matmul with an ``in × out`` weight over ``m`` rows moves the
weight once plus its input and output activations, ``bytes_per_elem · (in·out + m·in + m·out)``, for
``2·m·in·out`` FLOPs. For one d×d projection in fp32 (4 bytes per element) this reproduces seed 004's numbers:
d = 2048, 256 rows → 102.4 FLOP/byte; 8 rows → 3.97 FLOP/byte.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from twophase.config import ModelConfig


def intensity_of_projection(d: int, m: int, bytes_per_elem: float = 4) -> float:
    """FLOP/byte of one d×d projection over m rows: 2md² / (bytes · (d² + 2md)) — weights + input + output."""
    return (2 * m * d * d) / (bytes_per_elem * (d * d + 2 * m * d))


@dataclass(frozen=True)
class StepCost:
    """Analytic work of one forward step."""

    flops: float
    bytes: float
    weight_bytes: float
    kv_bytes: float
    activation_bytes: float

    @property
    def intensity(self) -> float:
        """Arithmetic intensity in FLOP/byte."""
        return self.flops / self.bytes if self.bytes else 0.0

    def to_dict(self) -> dict:
        """Plain dict including the intensity."""
        return {**asdict(self), "intensity": self.intensity}


def _layer_linears(config: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of every matmul weight of one decoder layer."""
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return [(d, q + 2 * kv), (q, d), (d, 2 * f), (f, d)]


def step_cost(
    config: ModelConfig, query_len: int, context_before: int, num_seqs: int, bytes_per_elem: float
) -> StepCost:
    """Cost of ``num_seqs`` sequences each computing ``query_len`` new tokens on ``context_before`` cached ones,
    with logits for the last token of each sequence (what `bench phases` times).

    FLOPs = 2 × matmul params × tokens + LM head + attention (4 · layers · Σ ctx · q_dim, causal);
    bytes = weights once + K/V read and written + activations in and out of every matmul.
    """
    tokens = query_len * num_seqs
    layers, d, v = config.num_hidden_layers, config.hidden_size, config.vocab_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    linears = _layer_linears(config)
    linear_params = layers * sum(i * o for i, o in linears)
    linear_act = layers * sum(i + o for i, o in linears) * tokens
    # each new token attends to the cached context plus the new tokens up to itself
    ctx_sum = num_seqs * (query_len * context_before + query_len * (query_len + 1) // 2)
    flops = 2 * linear_params * tokens + 2 * v * d * num_seqs + 4 * layers * ctx_sum * q_dim
    weight_bytes = bytes_per_elem * (linear_params + v * d)
    kv_read = num_seqs * (context_before + query_len) * 2 * kv_dim * layers
    kv_write = tokens * 2 * kv_dim * layers
    kv_bytes = bytes_per_elem * (kv_read + kv_write)
    act_bytes = bytes_per_elem * (linear_act + num_seqs * (d + v))
    return StepCost(flops, weight_bytes + kv_bytes + act_bytes, weight_bytes, kv_bytes, act_bytes)


@dataclass
class Ceilings:
    """This machine's measured memory bandwidth (bytes/s) and matmul rate per dtype (FLOP/s)."""

    device: str
    bandwidth: float
    matmul_flops: dict[str, float] = field(default_factory=dict)

    def ridge_point(self, dtype: str) -> float:
        """Intensity (FLOP/byte) above which a kernel is compute-bound: peak FLOP/s ÷ bandwidth."""
        return self.matmul_flops[dtype] / self.bandwidth

    def to_dict(self) -> dict:
        """Plain dict with ridge points."""
        return {**asdict(self), "ridge_points": {k: self.ridge_point(k) for k in self.matmul_flops}}


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(device: torch.device, num_bytes: int, repeats: int = 3) -> float:
    """Bytes/s of a large tensor copy (each copy reads and writes ``num_bytes``)."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)  # [N]
    dst = torch.empty_like(src)
    seconds = _best_time(lambda: dst.copy_(src), device, repeats)
    return 2 * src.numel() * 4 / seconds


def measure_matmul(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 3) -> float:
    """FLOP/s of an n×n×n GEMM in ``dtype``."""
    a = torch.randn(n, n, device=device).to(dtype)  # [n, n]
    b = torch.randn(n, n, device=device).to(dtype)  # [n, n]
    seconds = _best_time(lambda: a @ b, device, repeats)
    return 2 * n**3 / seconds


def instruction_peak(dtype: torch.dtype, seconds: float = 0.2, tries: int = 3) -> float | None:
    """FLOP/s of this CPU's matmul instruction for ``dtype`` (bfloat16: ``vdpbf16ps``, float32: the widest FMA) on
    every torch thread at once: the compute floor a GEMM is measured against (a GEMM of torch's runs below it). The
    kernels' measurement, best of ``tries`` runs (``gemm.instruction_rate``: a single run once put the prefill floor
    below the rate twophase reached); None where they are not built or the CPU lacks the instruction."""
    from twophase.model.ops.gemm import instruction_rate

    return instruction_rate(dtype_name(dtype), seconds, tries)


def time_floor(cost: StepCost, peak_flops: float, bandwidth: float) -> float:
    """Seconds no engine can beat for a step of ``cost`` on this machine: its FLOPs at the peak or its bytes at the
    bandwidth, whichever takes longer."""
    return max(cost.flops / peak_flops, cost.bytes / bandwidth)


def decode_floor(config: ModelConfig, batch: int, context: int, steps: int, bytes_per_elem: float,
                 peak_flops: float, bandwidth: float) -> float:
    """Seconds of ``steps`` decode steps of ``batch`` sequences whose context grows from ``context`` tokens."""
    return sum(time_floor(step_cost(config, 1, context + t, batch, bytes_per_elem), peak_flops, bandwidth)
               for t in range(steps))


def serving_floor(config: ModelConfig, num_prompts: int, input_len: int, output_len: int, concurrency: int,
                  bytes_per_elem: float, peak_flops: float, bandwidth: float) -> float:
    """Output tok/s no engine can beat serving ``num_prompts`` prompts of ``input_len`` tokens, ``output_len`` out,
    ``concurrency`` at a time: waves of ``concurrency`` prompts, each one prefill (the first token) and
    ``output_len - 1`` decode steps of the whole wave, at ``time_floor`` a step."""
    seconds, left = 0.0, num_prompts
    while left > 0:
        wave = min(concurrency, left)
        seconds += time_floor(step_cost(config, input_len, 0, wave, bytes_per_elem), peak_flops, bandwidth)
        seconds += decode_floor(config, wave, input_len, output_len - 1, bytes_per_elem, peak_flops, bandwidth)
        left -= wave
    return num_prompts * output_len / seconds


def measure_ceilings(
    device: torch.device, dtypes: Sequence[torch.dtype], copy_bytes: int | None = None, gemm_n: int | None = None
) -> Ceilings:
    """Measure bandwidth and per-dtype matmul rate; sizes default to large-enough for the device."""
    is_cuda = device.type == "cuda"
    copy_bytes = copy_bytes or (2 << 30 if is_cuda else 128 << 20)
    gemm_n = gemm_n or (8192 if is_cuda else 2048)
    return Ceilings(
        device=str(device),
        bandwidth=measure_bandwidth(device, copy_bytes),
        matmul_flops={dtype_name(dt): measure_matmul(device, dt, gemm_n) for dt in dtypes},
    )


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32."""
    return str(dtype).removeprefix("torch.")


def compute_bound_batch(
    config: ModelConfig, context: int, bytes_per_elem: float, ridge: float, max_batch: int = 1 << 16
) -> int | None:
    """Smallest decode batch whose analytic intensity reaches the ridge point (None if beyond ``max_batch``)."""
    batch = 1
    while batch <= max_batch:
        if step_cost(config, 1, context, batch, bytes_per_elem).intensity >= ridge:
            lo, hi = batch // 2 + 1, batch  # refine by bisection between the last two powers of two
            while lo < hi:
                mid = (lo + hi) // 2
                ok = step_cost(config, 1, context, mid, bytes_per_elem).intensity >= ridge
                lo, hi = (lo, mid) if ok else (mid + 1, hi)
            return lo
        batch *= 2
    return None


def plot_roofline(points: list[dict], ceilings: Ceilings | None, dtype: str, path: str | Path, title: str = "") -> Path:
    """Log-log roofline: measured (intensity, FLOP/s) points over the bandwidth and compute ceilings."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 5.5))
    xs = np.array([p["intensity"] for p in points] or [1.0])
    lo, hi = xs.min() / 4, xs.max() * 4
    if ceilings is not None and dtype in ceilings.matmul_flops:
        peak, ridge = ceilings.matmul_flops[dtype], ceilings.ridge_point(dtype)
        lo, hi = min(lo, ridge / 8), max(hi, ridge * 8)
        grid = np.geomspace(lo, hi, 200)
        ax.plot(grid, np.minimum(peak, ceilings.bandwidth * grid), "k-", lw=2, label="roofline")
        ax.axhline(peak, color="tab:red", ls=":", label=f"matmul {dtype}: {peak / 1e9:.1f} GFLOP/s")
        ax.plot(grid, ceilings.bandwidth * grid, color="tab:blue", ls=":", label=f"copy: {ceilings.bandwidth / 1e9:.1f} GB/s")
        ax.axvline(ridge, color="gray", ls="--", lw=0.8, label=f"ridge {ridge:.1f} FLOP/B")
    for kind, marker, color in (("prefill", "o", "tab:orange"), ("decode", "s", "tab:green")):
        sel = [p for p in points if p["kind"] == kind]
        ax.scatter([p["intensity"] for p in sel], [p["flops_per_s"] for p in sel], marker=marker, color=color,
                   label=kind, zorder=3)
        for p in sel:
            ax.annotate(p["name"], (p["intensity"], p["flops_per_s"]), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), xlabel="arithmetic intensity (FLOP/byte)",
           ylabel="achieved FLOP/s", title=title or "roofline")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
