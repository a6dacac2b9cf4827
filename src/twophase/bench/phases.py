"""`twophase bench phases`: llama-bench-style prefill/decode numbers, the batched table, and the roofline.

Usage::

    twophase bench phases --config tiny -p 16,32 -n 8 -b 1,2,4 -r 2 --measure-ceilings \\
        --output-json phases.json --roofline-png roofline.png
    twophase bench phases --tp 3 -p 128 -n 16 -b 1 -r 1    # the default model on 3 ranks
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from twophase.bench.phase_timer import (
    SYNTHETIC_CONFIGS, PhaseBench, PhasePlan, PhaseResult, SyntheticSource, bench_engine_config, run_plan,
)  # fmt: skip
from twophase.bench.roofline import Ceilings, compute_bound_batch, dtype_name, measure_ceilings, plot_roofline
from twophase.config import ConfigError, EngineConfig


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def register_phases(bench_subparsers) -> argparse.ArgumentParser:
    """Add `phases` to the `bench` subcommands."""
    p = bench_subparsers.add_parser("phases", help="time prefill and decode apart and place them on a roofline")
    p.add_argument("--model", "-m", default=None, help="store name, HF directory or .gguf (default: the default model)")
    p.add_argument("--config", choices=sorted(SYNTHETIC_CONFIGS), default=None,
                   help="a synthetic config with random weights instead of --model")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("-p", "--n-prompt", type=_int_list, default=[128, 512, 2048], help="prefill lengths")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="decode steps")
    p.add_argument("-b", "--batch-size", type=_int_list, default=[1, 2, 4, 8, 16, 32, 64], help="decode batch sizes")
    p.add_argument("-d", "--n-depth", type=int, default=0, help="context depth before each test")
    p.add_argument("-r", "--repetitions", type=int, default=3)
    p.add_argument("--batched-pp", type=int, default=None, help="PP of the batched table (default: first -p)")
    p.add_argument("--measure-ceilings", action="store_true", help="measure memory bandwidth and matmul FLOP/s")
    p.add_argument("--ceiling-dtypes", default=None, help="dtypes for the GEMM ceiling (default: the run's dtype)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--roofline-png", default=None)
    p.add_argument("--threads", type=int, default=None, help="intra-op threads per rank (default: cores / ranks)")
    from twophase.cli import add_parallel_arguments

    add_parallel_arguments(p)
    p.set_defaults(func=cmd_phases, engine_config=engine_config)
    return p


def plan_from_args(args: argparse.Namespace) -> PhasePlan:
    """What to measure (-p, -n, -b, -d, -r, --batched-pp)."""
    return PhasePlan(args.n_prompt, args.n_gen, args.batch_size, args.n_depth, args.repetitions, args.batched_pp)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine config of a `bench phases` run (a worker host of it reads its ranks, threads and device)."""
    from twophase.cli import parallel_config_from_args
    from twophase.loader import DEFAULT_MODEL

    model = args.config or str(args.model or DEFAULT_MODEL)
    return bench_engine_config(model, args.dtype, args.device, plan_from_args(args),
                               parallel=parallel_config_from_args(args), num_threads=args.threads)  # fmt: skip


def _open(args: argparse.Namespace, config: EngineConfig) -> PhaseBench:
    """Rank 0's bench on the model (or synthetic config) of ``args``, its other ranks started."""
    if not args.config:
        from twophase.loader import open_model_source

        return PhaseBench.start(config, open_model_source(config.model))
    from twophase.distributed.launch import topology
    from twophase.distributed.sharding import check_size

    source = SyntheticSource(SYNTHETIC_CONFIGS[args.config])
    size = topology(config.parallel).world_size
    if size > 1:
        check_size(source.config, size)  # the usual refusal first
        raise ConfigError("--tensor-parallel-size > 1 needs --model: every rank loads its own shard of the "
                          "model's files (--config random weights run on one rank)")  # fmt: skip
    return PhaseBench.start(config, source)


def run_phases(args: argparse.Namespace) -> dict:
    """Measure everything the arguments ask for and return the JSON-ready result."""
    if args.n_gen < 1 or args.repetitions < 1:
        raise ValueError("-n and -r must be at least 1")
    plan = plan_from_args(args)
    config = engine_config(args)
    bench = _open(args, config)
    try:
        dtype = bench.runner.dtype
        ceilings = None
        if args.measure_ceilings:
            names = (args.ceiling_dtypes or dtype_name(dtype)).split(",")
            ceilings = measure_ceilings(bench.device, [getattr(torch, n) for n in names])
        rows, batched = run_plan(bench, plan)
    finally:
        bench.close()
    return assemble(config.model, bench, dtype, plan, rows, batched, ceilings)


def assemble(model_name: str, bench: PhaseBench, dtype: torch.dtype, plan: PhasePlan, rows: list[PhaseResult],
             batched: list[dict], ceilings: Ceilings | None) -> dict:  # fmt: skip
    """The `bench phases` JSON: results, batched rows, ceilings and the compute-bound batch."""
    peak = ceilings.matmul_flops.get(dtype_name(dtype)) if ceilings else None
    bw = ceilings.bandwidth if ceilings else None
    out = {
        "model": model_name, "params": bench.config.num_params, "dtype": dtype_name(dtype), "device": str(bench.device),
        "plan": vars(plan) | {"pp_batched": plan.pp_batched},
        "results": [r.to_dict(peak, bw) for r in rows],
        "batched": [{**{k: v for k, v in b.items() if k in ("pp", "tg", "batch")},
                     "prefill": b["prefill"].to_dict(peak, bw), "decode": b["decode"].to_dict(peak, bw)}
                    for b in batched],
        "ceilings": ceilings.to_dict() if ceilings else None,
        "compute_bound_batch": None,
        "tensor_parallel_size": bench.tp.size if bench.tp else 1,
        "tensor_parallel_backend": bench.tp.backend if bench.tp else None,
        "threads_per_rank": torch.get_num_threads(),
    }  # fmt: skip
    if peak:
        ctx = plan.depth + plan.pp_batched + plan.decode_steps // 2
        out["compute_bound_batch"] = compute_bound_batch(bench.config, ctx, bench.bytes_per_elem, peak / bw)
    return out


def roofline_points(result: dict) -> list[dict]:
    """Every measured shape as a roofline point (prefill rows, then one decode point per batch size)."""
    points = [r for r in result["results"] if r["kind"] == "prefill"]
    points += [b["decode"] for b in result["batched"]] or [r for r in result["results"] if r["kind"] == "decode"]
    return points


def _rate(row: dict) -> str:
    return f"{row['tokens_per_s_mean']:.2f} ± {row['tokens_per_s_std']:.2f}"


def _util(row: dict) -> str:
    if row["kind"] == "prefill":
        return f"MFU {row['mfu'] * 100:.1f}%" if row["mfu"] is not None else ""
    return f"BW {row['bandwidth_utilization'] * 100:.1f}%" if row["bandwidth_utilization"] is not None else ""


def format_result(result: dict) -> str:
    """llama-bench's table (plus analytic cost), the batched table and the ceilings summary."""
    width = max(20, len(result["model"]))
    head = f"| {'model':<{width}} | {'params':>8} | {'dtype':<8} | {'test':>16} | {'t/s':>20} | FLOP/B | GFLOP/s | GB/s | util |"
    lines = [head, "|" + "|".join("-" * (len(c) + 0) for c in head.split("|")[1:-1]) + "|"]
    for r in result["results"]:
        lines.append(
            f"| {result['model']:<{width}} | {result['params'] / 1e6:>7.1f}M | {result['dtype']:<8} | {r['name']:>16} "
            f"| {_rate(r):>20} | {r['intensity']:6.1f} | {r['flops_per_s'] / 1e9:7.2f} | {r['bytes_per_s'] / 1e9:4.1f} "
            f"| {_util(r)} |"
        )
    lines += ["", "|    PP |    TG |    B |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s | TG FLOP/B | TG GB/s | util |",
              "|-------|-------|------|----------|----------|----------|----------|-----------|---------|------|"]  # fmt: skip
    for b in result["batched"]:
        pp, tg = b["prefill"], b["decode"]
        lines.append(
            f"| {b['pp']:5d} | {b['tg']:5d} | {b['batch']:4d} | {pp['seconds_mean']:8.3f} | {pp['tokens_per_s_mean']:8.1f} "
            f"| {tg['seconds_mean']:8.3f} | {tg['tokens_per_s_mean']:8.1f} | {tg['intensity']:9.2f} "
            f"| {tg['bytes_per_s'] / 1e9:7.2f} | {_util(tg)} |"
        )
    lines += _ceiling_lines(result) + _tensor_parallel_lines(result)
    return "\n".join(lines)


def _tensor_parallel_lines(result: dict) -> list[str]:
    """Rank 0's all-reduces per forward step of every shape, when more than one rank ran."""
    size = result.get("tensor_parallel_size", 1)
    if size == 1:
        return []
    lines = ["", f"tensor parallel: {size} ranks ({result['tensor_parallel_backend']}, threads per rank: "
                 f"{result['threads_per_rank']}); rank 0's all-reduces per forward step:"]  # fmt: skip
    rows = result["results"] + [b[k] for b in result["batched"] for k in ("prefill", "decode")]
    for r in rows:
        steps = 1 if r["kind"] == "prefill" else r["tokens_per_seq"]
        step_ms = 1000 * r["seconds_mean"] / steps
        lines.append(f"  {r['name']:>16}: {r['all_reduces_per_step']:.0f} all-reduces, "
                     f"{r['all_reduce_ms_per_step']:.2f} ms in them of {step_ms:.2f} ms per step")  # fmt: skip
    if result["tensor_parallel_backend"] == "gloo":
        lines.append("(gloo all-reduces cost milliseconds and the ranks of one host share its cores: expect tp > 1 "
                     "to be slower than tp = 1 on a CPU)")  # fmt: skip
    return lines


def _ceiling_lines(result: dict) -> list[str]:
    c = result["ceilings"]
    if not c:
        return ["", "(run with --measure-ceilings for bandwidth, MFU and the compute-bound batch size)"]
    lines = ["", f"ceilings on {c['device']}: memory copy {c['bandwidth'] / 1e9:.1f} GB/s"]
    for name, flops in c["matmul_flops"].items():
        lines.append(f"  matmul {name}: {flops / 1e9:.1f} GFLOP/s, ridge point {c['ridge_points'][name]:.1f} FLOP/byte")
    batch = result["compute_bound_batch"]
    where = f"batch ≈ {batch}" if batch else "no batch up to 65536"
    lines.append(f"decode turns compute-bound at {where} (analytic intensity reaches the {result['dtype']} ridge point)")
    return lines


def cmd_phases(args: argparse.Namespace) -> int:
    """twophase bench phases."""
    result = run_phases(args)
    print(format_result(result))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.output_json}")
    if args.roofline_png:
        ceilings = None
        if result["ceilings"]:
            c = result["ceilings"]
            ceilings = Ceilings(c["device"], c["bandwidth"], c["matmul_flops"])
        plot_roofline(roofline_points(result), ceilings, result["dtype"], args.roofline_png,
                      title=f"{result['model']} ({result['dtype']}, {result['device']})")  # fmt: skip
        print(f"wrote {args.roofline_png}")
    return 0
