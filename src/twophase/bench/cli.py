"""`twophase bench serve` (and, when its module exists, `twophase bench phases`): command-line wiring.

The flags follow `vllm bench serve` (same names, same defaults) where vLLM has them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from twophase.bench import datasets
from twophase.bench.metrics import METRIC_NAMES, best_passing_point, parse_goodput
from twophase.bench.serve import (
    LoadConfig, auth_headers, benchmark, default_filename, format_result, plot_results, result_json, save_json,
)  # fmt: skip


def register(subparsers: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """Add `bench` with its own subcommands; returns them so other modules can add theirs."""
    bench = subparsers.add_parser("bench", help="benchmarks: serving client (serve), phase microbench (phases)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    serve = bench_sub.add_parser("serve", help="benchmark an OpenAI-compatible server (vLLM-comparable)")
    add_serve_arguments(serve)
    serve.set_defaults(func=cmd_bench_serve)
    try:
        from twophase.bench.phases import register_phases
    except ModuleNotFoundError as exc:
        if exc.name != "twophase.bench.phases":
            raise
    else:
        register_phases(bench_sub)
    return bench_sub


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Every `bench serve` flag: the server connection, then the workload (shared with `twophase sim`)."""
    add = parser.add_argument
    add("--base-url", default=None, help="server URL; default http://HOST:PORT")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    add("--model", default=None, help="model name sent in requests; default: the first of GET /v1/models")
    add("--tokenizer", default=None, help="local tokenizer (HF dir, .gguf, store name); default: server /tokenize")
    add_workload_arguments(parser)
    add("--num-warmups", type=int, default=0)
    add("--ready-check-timeout-sec", type=int, default=600, help="0 skips the initial test request")
    add("--ignore-eos", action="store_true", help="(always on for the random dataset, as in vLLM)")
    add("--temperature", type=float, default=None)
    add("--top-p", type=float, default=None)
    add("--top-k", type=int, default=None)
    add("--min-p", type=float, default=None)
    add("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")
    add("--disable-tqdm", action="store_true")
    add("--sweep", default=None, metavar="rate=1,2,4 | concurrency=1,4,16",
        help="run once per request rate or concurrency level; prints the latency-throughput table")
    add("--plot", nargs="?", const="", default=None, metavar="PNG", help="latency-throughput PNG (also with --sweep)")


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload, traffic, SLO and result flags (`bench serve` and `twophase sim`)."""
    add = parser.add_argument
    add("--label", default=None, help="result file label (default: twophase)")
    add("--dataset-name", default="random", choices=["random", "prefix-repetition", "sharegpt", "custom"])
    add("--dataset-path", default=None, help="ShareGPT JSON or custom JSONL file")
    add("--num-prompts", type=int, default=1000)
    add("--random-input-len", type=int, default=1024)
    add("--random-output-len", type=int, default=128)
    add("--random-range-ratio", type=float, default=0.0, help="lengths uniform on [L(1-r), L(1+r)]")
    add("--prefix-repetition-prefix-len", type=int, default=256)
    add("--prefix-repetition-suffix-len", type=int, default=256)
    add("--prefix-repetition-num-prefixes", type=int, default=10)
    add("--prefix-repetition-output-len", type=int, default=128)
    add("--sharegpt-output-len", type=int, default=None)
    add("--custom-output-len", type=int, default=256)
    add("--request-rate", type=float, default=float("inf"), help="requests/s; inf sends all at once")
    add("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps; 1 = Poisson")
    add("--max-concurrency", type=int, default=None)
    add("--seed", type=int, default=0)
    add("--percentile-metrics", default="ttft,tpot,itl", help="subset of ttft,tpot,itl,e2el")
    add("--metric-percentiles", default="99", help="e.g. 50,90,99")
    add("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:5000")
    add("--slo-attainment", type=float, default=0.9, help="attainment a sweep point needs to pass the SLO")
    add("--save-result", action="store_true")
    add("--save-detailed", action="store_true", help="include per-request lists in the JSON")
    add("--result-dir", default=None)
    add("--result-filename", default=None)


def load_config(args: argparse.Namespace, base_url: str, model: str) -> LoadConfig:
    """LoadConfig from the parsed flags."""
    metrics = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    unknown = set(metrics) - set(METRIC_NAMES)
    if unknown:
        raise ValueError(f"unknown --percentile-metrics {sorted(unknown)}; use {','.join(METRIC_NAMES)}")
    sampling = {name: getattr(args, name) for name in ("temperature", "top_p", "top_k", "min_p")
                if getattr(args, name) is not None}  # as vLLM's bench serve sends them
    extra = {**sampling, **(args.extra_body or {})}
    return LoadConfig(
        api_url=base_url + args.endpoint, model=model, request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, num_warmups=args.num_warmups,
        ignore_eos=args.ignore_eos or args.dataset_name == "random", ready_check=args.ready_check_timeout_sec > 0,
        extra_body=extra, percentile_metrics=metrics,
        percentiles=tuple(float(p) for p in args.metric_percentiles.split(",")), goodput=parse_goodput(args.goodput),
        seed=args.seed, disable_tqdm=args.disable_tqdm,
    )  # fmt: skip


def discover_model(base_url: str) -> str:
    """The first model id the server lists at GET /v1/models."""
    response = httpx.get(f"{base_url}/v1/models", timeout=30, headers=auth_headers())
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def choose_counter(args: argparse.Namespace, base_url: str, model: str) -> datasets.TokenCounter:
    """Local tokenizer if given, else the server's /tokenize + /detokenize, else the word approximation."""
    if args.tokenizer:
        return datasets.LocalCounter(args.tokenizer)
    server = datasets.ServerCounter(base_url, model, httpx.Client(timeout=60, headers=auth_headers()))
    if server.available():
        return server
    print("note: no --tokenizer and the server has no /tokenize; prompt lengths are approximate (1 word ≈ 1 token)")
    return datasets.WordCounter()


def load_requests(args: argparse.Namespace, counter: datasets.TokenCounter) -> list[datasets.SampleRequest]:
    """The workload the flags describe."""
    rng = np.random.default_rng(args.seed)
    name = args.dataset_name
    if name == "random":
        return datasets.random_dataset(counter, args.num_prompts, args.random_input_len, args.random_output_len,
                                       args.random_range_ratio, rng)
    if name == "prefix-repetition":
        return datasets.prefix_repetition_dataset(
            counter, args.num_prompts, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len, rng)
    if not args.dataset_path:
        raise ValueError(f"--dataset-name {name} needs --dataset-path")
    if name == "sharegpt":
        return datasets.sharegpt_dataset(args.dataset_path, counter, args.num_prompts, rng, args.sharegpt_output_len)
    return datasets.custom_dataset(args.dataset_path, counter, args.num_prompts, args.custom_output_len, rng)


def parse_sweep(text: str) -> tuple[str, list[float]]:
    """'rate=1,2,inf' → ('request_rate', [1, 2, inf]); 'concurrency=1,4' → ('max_concurrency', [1, 4])."""
    kind, _, values = text.partition("=")
    fields = {"rate": "request_rate", "concurrency": "max_concurrency"}
    if kind not in fields or not values:
        raise ValueError("--sweep takes rate=V1,V2,... or concurrency=V1,V2,...")
    return fields[kind], [float(v) for v in values.split(",")]


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Run one benchmark (or a sweep), print vLLM's block, save JSON and plots on request."""
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    model = args.model or discover_model(base_url)
    config = load_config(args, base_url, model)
    requests = load_requests(args, choose_counter(args, base_url, model))
    if not requests:
        raise ValueError("the workload produced no requests")
    meta = {"endpoint_type": "openai-chat" if "chat" in args.endpoint else "openai", "label": args.label,
            "model_id": model, "tokenizer_id": args.tokenizer or model, "num_prompts": args.num_prompts}
    if args.sweep:
        return run_sweep(args, config, requests, meta)
    result = asyncio.run(benchmark(config, requests))
    print(format_result(result, config))
    meta["backend"] = meta["endpoint_type"]
    traffic = {"request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
               "burstiness": args.burstiness, "max_concurrency": args.max_concurrency}
    data = result_json({**meta, **traffic}, result, args.save_detailed)
    filename = args.result_filename or default_filename(args.label or "twophase", args.request_rate,
                                                        args.max_concurrency, model, data["date"])
    if args.save_result:
        print(f"saved {save_json(data, args.result_dir, filename)}")
    if args.plot is not None:
        png = Path(args.plot) if args.plot else Path(args.result_dir or ".") / (Path(filename).stem + ".png")
        print(f"plot {plot_results([result], png)}")
    return 0


def run_sweep(args: argparse.Namespace, config: LoadConfig, requests: list[datasets.SampleRequest],
              meta: dict[str, Any]) -> int:
    """One run per sweep value; prints the latency–throughput table and the best point meeting the SLOs."""
    key, values = parse_sweep(args.sweep)
    points = []
    for value in values:
        point_config = dataclasses.replace(config, **{key: int(value) if key == "max_concurrency" else value})
        result = asyncio.run(benchmark(point_config, requests))
        print(format_result(result, point_config))
        result.update(sweep_value=value, request_rate=point_config.request_rate,
                      max_concurrency=point_config.max_concurrency)
        points.append(result)
    print(format_sweep_table(points, key))
    best = best_passing_point(points, "sweep_value", args.slo_attainment) if config.goodput else None
    if config.goodput:
        verdict = f"{best['sweep_value']:g}" if best else "none"
        print(f"Highest {key} meeting the SLOs at >= {100 * args.slo_attainment:.0f}% attainment: {verdict}")
    date = result_json({}, {}, False)["date"]
    filename = args.result_filename or f"{args.label or 'twophase'}-sweep-{key}-{model_tail(meta)}-{date}.json"
    if args.save_result:
        rows = [result_json({}, p, args.save_detailed) for p in points]
        data = {**meta, "date": date, "sweep": key, "points": rows, "best": best and best["sweep_value"]}
        print(f"saved {save_json(_jsonable(data), args.result_dir, filename)}")
    png = Path(args.plot) if args.plot else Path(args.result_dir or ".") / (Path(filename).stem + ".png")
    print(f"plot {plot_results(points, png, key.replace('_', ' '))}")
    return 0


def model_tail(meta: dict[str, Any]) -> str:
    """The last path component of the model id (for file names)."""
    return str(meta["model_id"]).rstrip("/").split("/")[-1]


def _jsonable(data: dict[str, Any]) -> dict[str, Any]:
    """inf request rates as the string 'inf', as vLLM writes them."""
    return json.loads(json.dumps(data).replace("Infinity", '"inf"'))


def format_sweep_table(points: list[dict[str, Any]], key: str) -> str:
    """One row per sweep point: load, throughput, latency and (with SLOs) goodput and attainment."""
    head = f"{key:>16} {'req/s':>8} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} " \
           f"{'TPOT p99':>9} {'goodput':>8} {'attain%':>8}"
    rows = [head, "-" * len(head)]
    for p in points:
        attained = p.get("slo_attainment", {}).get("all")
        rows.append(
            f"{p['sweep_value']:>16g} {p['request_throughput']:>8.2f} {p['output_throughput']:>10.2f} "
            f"{p.get('median_ttft_ms', float('nan')):>9.1f} {_p99(p, 'ttft'):>9.1f} "
            f"{p.get('median_tpot_ms', float('nan')):>9.1f} {_p99(p, 'tpot'):>9.1f} "
            f"{p['request_goodput'] if p.get('request_goodput') is not None else float('nan'):>8.2f} "
            f"{100 * attained if attained is not None else float('nan'):>8.1f}"
        )
    return "\n".join(rows)


def _p99(point: dict[str, Any], key: str) -> float:
    """The highest reported percentile of a metric (p99 by default)."""
    found = [k for k in point if k.startswith("p") and k.endswith(f"_{key}_ms")]
    return float(point[found[-1]]) if found else float("nan")
