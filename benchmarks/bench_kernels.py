"""Kernel benchmark on this machine: memory bandwidth, linear layers over SmolLM2-135M's 121 matrices,
attention-free layer stacks (eager torch, torch.compile, our kernels), paged attention decode.
Usage: ``python benchmarks/bench_kernels.py [--quick] [--compile] [--layers-only] [--gemm]``."""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from twophase.model.ops.extension import load_kernels
from twophase.model.ops.linear import BlockPanelLinear, KernelLinear
from twophase.model.ops.quant import quantize_q4_1, quantize_q8_0
from twophase.model.attention import reference_paged_attention

HIDDEN, INTER, LAYERS, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 30, 49152, 9, 3, 64
LAYER_SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # (N, K)


def model_shapes(layers: int) -> list[tuple[int, int]]:
    """(N, K) of every matmul in a forward: qkv, o, gate_up, down per layer, then lm_head."""
    return LAYER_SHAPES * layers + [(VOCAB, HIDDEN)]


def best_time(fn: Callable[[], object], reps: int) -> float:
    """Best wall time of ``reps`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def read_bandwidth(reps: int) -> float:
    """GB/s of a reduction over a 512 MiB tensor."""
    big = torch.ones(128 * 2**20)
    return big.numel() * 4 / best_time(big.sum, reps) / 1e9


def nbytes(*tensors: torch.Tensor) -> int:
    """Total bytes of the tensors."""
    return sum(t.numel() * t.element_size() for t in tensors)


class PrepackedGemm:
    """oneDNN's float32 GEMM on a copy of the weight reordered into its blocked layout
    (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, what inductor's ``freezing`` compiles to):
    the reference our panel kernel is timed against (the engine used it beyond 32 rows until the panels beat it)."""

    PACK_ROWS = 32  # the batch size oneDNN packs for: a hint, any batch runs

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.PACK_ROWS)  # [out, in] logically

    @staticmethod
    @functools.cache
    def available(dtype: torch.dtype = torch.float32) -> bool:
        """Whether this torch build has oneDNN's reorder and it runs on this CPU for ``dtype`` (bfloat16 needs
        AVX-512 or AVX-NE-CONVERT)."""
        if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
            return False
        try:
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), PrepackedGemm.PACK_ROWS)
        except RuntimeError:  # an op registered for a CPU it does not support
            return False
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] float32 -> [T, out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def make_weights(shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Random fp32 weights, one per shape (scaled like a trained model)."""
    return [torch.randn(n, k) / k**0.5 for n, k in shapes]


def linear_variants(kern, weights: list[torch.Tensor], ms: list[int]) -> dict[str, tuple[list, Callable]]:
    """name -> (per-matrix packed args in the order of ``weights``, fn(x, *args)); built lazily so peak memory stays
    moderate."""
    v: dict[str, tuple[list, Callable]] = {
        "torch F.linear fp32": ([(w,) for w in weights], lambda x, w: F.linear(x, w)),
    }
    if PrepackedGemm.available():
        gemms = {id(w): PrepackedGemm(w) for w in weights}
        v["prepacked fp32 (oneDNN)"] = ([(w,) for w in weights], lambda x, w: gemms[id(w)](x))
    bf16 = [w.bfloat16() for w in weights]
    if PrepackedGemm.available(torch.bfloat16):  # what the engine's bfloat16 GEMMs below 128 rows run on, with AMX
        gemms16 = {id(w): PrepackedGemm(w) for w in bf16}
        v["prepacked bf16 (oneDNN)"] = ([(w,) for w in bf16], lambda x, w: gemms16[id(w)](x.bfloat16()).float())
    if kern is not None and kern.bf16_gemm_available():  # ... and without AMX (gemm.use_dot_weight)
        dots = {id(w): kern.pack_bf16_gemm(w) for w in bf16}
        v["ours bf16 dot (AVX512-BF16)"] = ([(w,) for w in bf16],
                                            lambda x, w: kern.bf16_gemm(x, dots[id(w)], w.shape[0], False))
    if kern is not None:
        for name, dtype in (("ours fp32 (panels)", torch.float32), ("ours bf16 (panels)", torch.bfloat16)):
            v[name] = op_variant([KernelLinear(w.to(dtype), None, kern) for w in weights], lambda p: (p.panels,))
        scales = [w.abs().amax(1) / 127 for w in weights]
        q8 = [(w / s[:, None]).round().to(torch.int8) for w, s in zip(weights, scales)]
        v["ours int8 (panels)"] = op_variant([KernelLinear(q, None, kern, scale=s) for q, s in zip(q8, scales)],
                                             lambda p: (p.panels, p.scale))
        v["torch _weight_int8pack_mm"] = (list(zip(q8, scales)), lambda x, q, s: torch._weight_int8pack_mm(x, q, s))
        v["ours q8_0 (x int8)"] = ([quantize_q8_0(w) for w in weights], lambda x, q, d: kern.linear_q8_0(x, q, d))
        v["ours q4_1 (x int8)"] = ([quantize_q4_1(w) for w in weights], lambda x, q, d, m: kern.linear_q4_1(x, q, d, m))
        for fmt, quantize in (("q8_0", quantize_q8_0), ("q4_1", quantize_q4_1)):  # the float32 default on GGUF files
            v[f"ours fp32 from {fmt} blocks"] = op_variant(
                [BlockPanelLinear((fmt, quantize(w)), None, kern) for w in weights], lambda p: (p.panels,))
    return v


def op_variant(layers: list, packed: Callable) -> tuple[list, Callable]:
    """A variant over layers with a C++ ``op``: args their packed tensors (``packed(layer)``, the bytes counted),
    fn runs the layer whose first packed tensor it is given."""
    by_tensor = {id(packed(layer)[0]): layer for layer in layers}
    return [packed(layer) for layer in layers], lambda x, t, *_: by_tensor[id(t)].op(x)


def bench_linear(kern, layers: int, ms: list[int], bw: float, reps: int) -> None:
    """Time one pass over all matrices per variant and M (variants interleaved, best of ``reps``, so load
    from other processes hits all alike); print ms, GB/s, % of the measured bandwidth."""
    weights = make_weights(model_shapes(layers))
    print(f"\n== linear over {len(weights)} matrices (SmolLM2-135M, {layers} layers) ==")
    print(f"{'variant':28s} " + " ".join(f"{'M=' + str(m):>24s}" for m in ms))
    variants = linear_variants(kern, weights, ms)
    best = {(name, m): float("inf") for name in variants for m in ms}
    for m in ms:
        xs = {HIDDEN: torch.randn(m, HIDDEN), INTER: torch.randn(m, INTER)}
        calls = {name: (lambda args=args, fn=fn: [fn(xs[w.shape[1]], *a) for w, a in zip(weights, args)])
                 for name, (args, fn) in variants.items() if fn is not None}
        if m > 8:  # no AVX2 path: tens of seconds per pass
            calls.pop("torch _weight_int8pack_mm", None)
        for f in calls.values():
            f()  # warm-up
        for _ in range(reps):
            for name, f in calls.items():
                t0 = time.perf_counter()
                f()
                best[name, m] = min(best[name, m], time.perf_counter() - t0)
    for name, (args, _) in variants.items():
        size = sum(nbytes(*a) for a in args)
        cells = []
        for m in ms:
            t = best[name, m]
            cells.append("skipped" if t == float("inf") else
                         f"{t * 1e3:7.1f}ms {size / t / 1e9:5.1f}GB/s {100 * size / t / 1e9 / bw:3.0f}%")
        print(f"{name:28s} " + " ".join(f"{c:>24s}" for c in cells))


def crossover(kern, reps: int) -> None:
    """Per-M timing of ours vs torch vs oneDNN's prepacked GEMM on the 576x1536 down projection and 3072x576
    gate_up."""
    print("\n== one matrix, us per call ==")
    for n, k in [(2 * INTER, HIDDEN), (HIDDEN, INTER)]:
        w = torch.randn(n, k)
        ours, ours_bf16 = KernelLinear(w, None, kern).op, KernelLinear(w.bfloat16(), None, kern).op
        gemm = PrepackedGemm(w) if PrepackedGemm.available() else (lambda x: F.linear(x, w))
        print(f"[{n}x{k}]  {'M':>4s} {'ours fp32':>10s} {'ours bf16':>10s} {'F.linear':>10s} {'prepacked':>10s}")
        for m in (1, 2, 4, 8, 16, 32, 64, 128):
            x = torch.randn(m, k)
            ts = [best_time(f, reps * 5) * 1e6 for f in (
                lambda: ours(x), lambda: ours_bf16(x), lambda: F.linear(x, w), lambda: gemm(x))]
            print(f"{'':14s}{m:4d} " + " ".join(f"{t:10.0f}" for t in ts))


def bench_gemm(kern, layers: int, reps: int) -> None:
    """float32 layers at growing M: the layer matrices (no LM head) through our panel kernel vs oneDNN's
    prepacked GEMM vs F.linear, each pass timed interleaved; median ms of ``reps`` passes and GFLOP/s."""
    weights = make_weights(LAYER_SHAPES * layers)
    if not PrepackedGemm.available():
        raise SystemExit("this torch build has no oneDNN reorder: no prepacked GEMM to compare with")
    gemms = [PrepackedGemm(w) for w in weights]
    ours = [KernelLinear(w, None, kern).op for w in weights]
    flop_per_row = 2 * sum(w.numel() for w in weights)
    print(f"\n== float32 GEMM: {len(weights)} layer matrices, median ms ==")
    print(f"{'M':>5s} {'ours':>9s} {'prepacked':>10s} {'F.linear':>9s} {'ours GFLOP/s':>13s} {'ours/prepacked':>15s} "
          f"{'F.linear/prepacked':>19s}")
    for m in (1, 4, 16, 32, 64, 128, 256, 512):
        xs = {HIDDEN: torch.randn(m, HIDDEN), INTER: torch.randn(m, INTER)}
        calls = [lambda: [p(xs[w.shape[1]]) for w, p in zip(weights, ours)],
                 lambda: [g(xs[w.shape[1]]) for w, g in zip(weights, gemms)],
                 lambda: [F.linear(xs[w.shape[1]], w) for w in weights]]
        times: list[list[float]] = [[], [], []]
        for f in calls:
            f()  # warm-up (and the first call packs)
        for _ in range(reps):
            for f, ts in zip(calls, times):
                t0 = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t0)
        mine, packed, plain = (sorted(ts)[len(ts) // 2] * 1e3 for ts in times)
        print(f"{m:5d} {mine:9.1f} {packed:10.1f} {plain:9.1f} {flop_per_row * m / mine / 1e6:13.0f} "
              f"{mine / packed:15.2f} {plain / packed:19.2f}")


def layer_weights(layers: int) -> list[tuple[torch.Tensor, ...]]:
    """Per layer: (input norm, qkv, o, post-attention norm, gate_up, down) float32 weights, random."""
    return [(torch.ones(HIDDEN), *make_weights(LAYER_SHAPES[:2]), torch.ones(HIDDEN), *make_weights(LAYER_SHAPES[2:]))
            for _ in range(layers)]


def torch_layers(x: torch.Tensor, weights: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """Attention-free decoder layers in plain torch ops, x [M, HIDDEN] → [M, HIDDEN]: RMSNorm, qkv, the q part
    through o_proj (standing in for attention), residual add, RMSNorm, gate_up, SiLU·up, down, residual add."""
    for norm1, qkv, o, norm2, gate_up, down in weights:
        h = F.rms_norm(x, (HIDDEN,), norm1, 1e-5)
        x = x + F.linear(F.linear(h, qkv)[:, :HIDDEN], o)
        h = F.rms_norm(x, (HIDDEN,), norm2, 1e-5)
        gate, up = F.linear(h, gate_up).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, down)
    return x


def kernel_layers(kern, x: torch.Tensor, weights: list[tuple]) -> torch.Tensor:
    """The same layers through our kernels (each matrix as its ``KernelLinear``'s op), one Python call per op (the engine's C++
    decoder stack makes the same calls without Python in between)."""
    residual = x.clone()
    h = kern.rms_norm(residual, weights[0][0], 1e-5)
    for i, (_, qkv, o, norm2, gate_up, down) in enumerate(weights):
        a = o(qkv(h)[:, :HIDDEN].contiguous())
        kern.add_rms_norm_(a, residual, norm2, 1e-5)  # residual += attn; a = norm2(residual)
        a = down(kern.silu_and_mul(gate_up(a)))
        next_norm = weights[i + 1][0] if i + 1 < len(weights) else weights[0][0]
        kern.add_rms_norm_(a, residual, next_norm, 1e-5)
        h = a
    return residual


def bench_layer_stack(kern, layers: int, ms: list[int], bw: float, reps: int, compiled: bool) -> None:
    """Attention-free float32 layer stacks: eager torch vs torch.compile (inductor, one graph per M) vs our
    kernels; ms per pass and GB/s of weights (the floor is the read bandwidth)."""
    weights = layer_weights(layers)
    size = sum(nbytes(*w[1:3], *w[4:]) for w in weights)
    print(f"\n== {layers} attention-free float32 layers ({size / 1e6:.0f} MB of matrices) ==")
    print(f"{'variant':34s} " + " ".join(f"{'M=' + str(m):>22s}" for m in ms))
    variants: dict[str, Callable] = {"eager torch": lambda x: torch_layers(x, weights)}
    if compiled:
        compiled_fn = torch.compile(torch_layers, dynamic=False)
        variants["torch.compile (inductor)"] = lambda x: compiled_fn(x, weights)
    if kern is not None:
        packed = [(n1, *(KernelLinear(w, None, kern).op for w in (qkv, o)), n2,
                   *(KernelLinear(w, None, kern).op for w in (gu, d))) for n1, qkv, o, n2, gu, d in weights]
        variants["ours (kernels, Python per op)"] = lambda x: kernel_layers(kern, x, packed)
    rows: dict[str, list[str]] = {name: [] for name in variants}
    for m in ms:
        x = torch.randn(m, HIDDEN)
        with torch.inference_mode():
            ref = torch_layers(x, weights)
            for name, fn in variants.items():
                t_first = time.perf_counter()
                out = fn(x)  # compiles on the first call for each M
                t_first = time.perf_counter() - t_first
                assert torch.allclose(out, ref, rtol=1e-3, atol=1e-3), f"{name} disagrees with eager torch at M={m}"
                t = best_time(lambda: fn(x), reps)
                note = f" (1st {t_first:.0f}s)" if t_first > 1 else ""
                rows[name].append(f"{t * 1e3:6.2f}ms {size / t / 1e9:5.1f}GB/s{note}")
    for name, cells in rows.items():
        print(f"{name:34s} " + " ".join(f"{c:>22s}" for c in cells))


def paged_case(batch: int, ctx: int, dtype: torch.dtype, q_len: int = 1, block_size: int = 16):
    """A batch of `batch` requests with `ctx` tokens each and `q_len` new queries, shuffled blocks."""
    per = -(-ctx // block_size)
    tables = torch.randperm(batch * per).to(torch.int32).view(batch, per)
    k = torch.randn(batch * per * block_size, KV_HEADS, HEAD_DIM).to(dtype)
    v = torch.randn_like(k)
    q = torch.randn(batch * q_len, HEADS, HEAD_DIM)
    if dtype != torch.float32:
        q = q.to(dtype)
    seq = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = (torch.arange(batch + 1) * q_len).to(torch.int32)
    return q, k, v, tables, seq, qsl, block_size, HEAD_DIM**-0.5


def bench_attention(kern, bw: float, reps: int) -> None:
    """Decode (and one prefill chunk): ours vs gather + SDPA per request."""
    print("\n== paged attention (H=9, KVH=3, D=64, block 16) ==")
    print(f"{'case':36s} {'ours':>10s} {'GB/s':>6s} {'gather+SDPA':>12s} {'speedup':>8s}")
    cases = [(b, c, 1) for b in (1, 32) for c in (256, 1024)] + [(1, 512, 512), (1, 2048, 256)]
    for dtype in (torch.float32, torch.bfloat16):
        for batch, ctx, q_len in cases:
            q, k, v, bt, seq, qsl, bs, sc = paged_case(batch, ctx, dtype, q_len)
            out = torch.empty_like(q)
            t_ours = best_time(lambda: kern.paged_attention(out, q, k, v, bt, seq, qsl, bs, sc), reps)
            t_ref = best_time(lambda: reference_paged_attention(q, k, v, bt, seq, qsl, bs), reps)
            kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * k.element_size()
            name = f"{str(dtype)[6:]} batch={batch} ctx={ctx} q_len={q_len}"
            print(f"{name:36s} {t_ours * 1e3:8.2f}ms {kv_bytes / t_ours / 1e9:6.1f} {t_ref * 1e3:10.2f}ms "
                  f"{t_ref / t_ours:7.1f}x")


def main() -> None:
    """Run every section and print the tables."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="3 layers instead of 30, fewer repetitions")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--rows", default="1,8,32", help="batch rows (M) of the linear table, comma-separated")
    ap.add_argument("--linear-only", action="store_true", help="only the bandwidth and linear tables")
    ap.add_argument("--layers-only", action="store_true", help="only the bandwidth and layer-stack tables")
    ap.add_argument("--gemm", action="store_true", help="only the bandwidth and float32 GEMM crossover tables")
    ap.add_argument("--compile", action="store_true",
                    help="add torch.compile (inductor) to the layer-stack table (compiles once per M: minutes)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kern = load_kernels()
    layers = 3 if args.quick else LAYERS
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, kernels: {kern is not None}")
    bw = read_bandwidth(args.reps + 2)
    print(f"read bandwidth (512 MiB sum): {bw:.1f} GB/s")
    rows = [int(m) for m in args.rows.split(",")]
    if args.gemm:
        return bench_gemm(kern, layers, max(args.reps, 5))
    if not args.layers_only:
        bench_linear(kern, layers, rows, bw, args.reps)
    if not args.linear_only:
        bench_layer_stack(kern, layers, rows, bw, args.reps, args.compile)
    if kern is not None and not (args.linear_only or args.layers_only):
        crossover(kern, args.reps)
        bench_attention(kern, bw, args.reps)


if __name__ == "__main__":
    main()
