"""`twophase sim` (predict a `bench serve` run without running it) and `twophase calibrate` (fit its step-time
model). `sim` takes bench serve's workload flags and the engine's flags; its output is bench serve's."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np

from twophase.bench.metrics import METRIC_NAMES, arrival_gaps, parse_goodput, send_offsets
from twophase.bench.serve import LoadConfig, build_result, format_result, result_json, save_json
from twophase.config import SchedulerConfig
from twophase.sim.simulator import DeliveryJitter, ModelPredictor, SimRequest, SimResult, Simulator
from twophase.steptime.model import StepTimeModel

SWEEP_KEYS = {"budget": "max_num_batched_tokens", "max-num-seqs": "max_num_seqs", "rate": "request_rate",
              "concurrency": "max_concurrency"}  # fmt: skip


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `sim` and `calibrate`."""
    from twophase.bench.cli import add_workload_arguments
    from twophase.cli import add_engine_arguments

    sim = subparsers.add_parser("sim", help="simulate a bench serve run from a step-time model (no model compute)",
                                conflict_handler="resolve")  # fmt: skip
    add_workload_arguments(sim)
    add_engine_arguments(sim)  # its --model (the model: tokenizer, KV size) and --seed replace the workload's
    sim.add_argument("--tokenizer", default=None, help="tokenizer for the prompts (default: the model's)")
    sim.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (default: sized as the engine does)")
    sim.add_argument("--gap-ms", type=float, default=None, help="inter-step gap (default: the calibrated one)")
    sim.add_argument("--admission-ms", type=float, default=None,
                     help="serving overhead per request outside the engine, added before its arrival there, "
                     "whatever the load (default: the calibrated one, growing with the requests in flight)")
    sim.add_argument("--rescale-from-records", nargs="+", default=None, metavar="JSON",
                     help="/v1/records dumps of the target server's latest runs: every predicted step is scaled by "
                     "their actual / predicted step time (the machine's drift since calibrating)")  # fmt: skip
    sim.add_argument("--rescale-weight", type=float, default=1.0, metavar="W",
                     help="with --rescale-from-records: scale by drift ** W, W in [0, 1] (default 1: the whole "
                     "drift; less trusts the dumps less, e.g. when they ran another mix of steps)")
    sim.add_argument("--noise", action="store_true",
                     help="multiply each predicted step by a residual ratio drawn from the calibration's steps of its "
                     "kind (default: the model's prediction; per-step draws widen the tails beyond a served run's)")
    sim.add_argument("--no-noise", action="store_true", help=argparse.SUPPRESS)  # the default since noise is opt-in
    sim.add_argument("--no-jitter", action="store_true",
                     help="the client receives each token as the engine produces it (default: with the served "
                     "calibration's delivery jitter, when the model has one)")  # fmt: skip
    sim.add_argument("--sweep", nargs="+", default=None, metavar="KEY=V1,V2",
                     help="grid over budget=, max-num-seqs=, rate= or concurrency=; reports the configuration with "
                     "the most goodput at >= --slo-attainment")  # fmt: skip
    sim.add_argument("--sweep-margin", type=float, default=0.0, metavar="F",
                     help="sweep: a configuration qualifies only if it also reaches --slo-attainment with every step "
                     "F longer (e.g. 0.12: room for a step-time model whose hold-out error is 12%%); default 0")
    sim.set_defaults(func=cmd_sim)
    cal = subparsers.add_parser("calibrate", help="time engine steps over a grid and fit the step-time model")
    add_engine_arguments(cal)
    cal.add_argument("--budgets", default="64,256,512", help="token budgets of the grid")
    cal.add_argument("--concurrency", default="1,4,16", help="requests per grid point")
    cal.add_argument("--prompt-lens", default="32,256,1024", help="prompt lengths of the grid")
    cal.add_argument("--output-len", type=int, default=16, help="tokens generated per request")
    cal.add_argument("--from-records", nargs="+", default=None, metavar="JSON",
                     help="fit on /v1/records dumps instead of running the grid")
    cal.add_argument("--served", nargs="+", default=None, metavar="JSON",
                     help="with --from-records: bench serve results (--save-detailed) of the runs the dumps cover; "
                     "fits the per-request serving overhead (client TTFT minus the engine's)")  # fmt: skip
    cal.add_argument("--output", "-o", default=None, help="model file (default: steptime-<model>.json)")
    cal.set_defaults(func=cmd_calibrate)


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise ValueError(f"{flag} takes positive integers, got {text!r}")
    return values


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Run the grid (or read dumps), fit, print the model, save it."""
    from twophase.sim.calibrate import describe_model, engine_meta, fit_from_dumps, fit_from_records, grid_records

    output = Path(args.output or f"steptime-{Path(str(args.model)).stem}.json")
    if args.served and not args.from_records:
        raise ValueError("--served takes the bench serve results of the runs --from-records dumps; give both")
    if args.from_records:
        model = fit_from_dumps(args.from_records, args.served)
        model.meta.update(model=str(args.model))
    else:
        from twophase.cli import engine_config_from_args
        from twophase.engine.llm_engine import LLMEngine

        grid = {"budgets": _ints(args.budgets, "--budgets"), "concurrency": _ints(args.concurrency, "--concurrency"),
                "prompt_lens": _ints(args.prompt_lens, "--prompt-lens"), "output_len": args.output_len}  # fmt: skip
        if args.output_len < 1:
            raise ValueError("--output-len must be at least 1")
        engine = LLMEngine(engine_config_from_args(args), progress=False)
        records = grid_records(engine, grid["budgets"], grid["concurrency"], grid["prompt_lens"], args.output_len,
                               args.seed)  # fmt: skip
        model = fit_from_records(records, engine_meta(engine, grid))
    print(describe_model(model))
    print(f"saved {model.save(output)}")
    return 0


@dataclasses.dataclass
class SimSetup:
    """Everything one simulated run needs besides the traffic."""

    scheduler: SchedulerConfig
    num_blocks: int
    block_size: int
    prefix_caching: bool
    model: StepTimeModel
    gap_s: float
    noise: bool
    admission_s: float = 0.0
    jitter: bool = False
    admission_per_stream_s: float = 0.0


def sim_setup(args: argparse.Namespace) -> SimSetup:
    """The engine shape the flags describe (as LLMEngine would size it) and the step-time model."""
    from twophase.cli import engine_config_from_args

    if not args.step_time_model:
        raise ValueError("twophase sim needs --step-time-model FILE (write one with `twophase calibrate`)")
    config = engine_config_from_args(args)
    model = StepTimeModel.load(config.scheduler.step_time_model)
    if args.rescale_from_records:
        from twophase.sim.calibrate import rescale_from_dumps

        model = rescale_from_dumps(model, args.rescale_from_records, args.rescale_weight)
    max_len, num_blocks = _engine_shape(config, args.num_kv_blocks)
    scheduler = dataclasses.replace(config.scheduler, max_model_len=max_len)
    gap = model.gap_s if args.gap_ms is None else args.gap_ms / 1000
    admission = model.admission_s if args.admission_ms is None else args.admission_ms / 1000  # checked by Simulator
    per_stream = model.admission_per_stream_s if args.admission_ms is None else 0.0
    noise, jitter = args.noise and not args.no_noise, not args.no_jitter and bool(model.jitter_s)
    return SimSetup(scheduler, num_blocks, config.cache.block_size, config.cache.enable_prefix_caching, model, gap,
                    noise, admission, jitter, per_stream)  # fmt: skip


def _engine_shape(config: Any, num_kv_blocks: int | None) -> tuple[int, int]:
    """(max_model_len, KV blocks) as the engine would choose them (the KV budget before loading the weights)."""
    import torch

    from twophase.engine import hardware
    from twophase.engine.llm_engine import engine_dtype, resolve_gemm_dtype
    from twophase.engine.model_runner import kv_bytes_per_block, resolve_cache_dtype
    from twophase.loader import open_model_source

    source = open_model_source(config.model)
    model_config = source.config
    max_len = min(config.scheduler.max_model_len, model_config.max_position_embeddings)
    if num_kv_blocks:
        return max_len, num_kv_blocks
    device = torch.device(config.device)
    cache_dtype = resolve_cache_dtype(config.cache.cache_dtype, engine_dtype(config, source),
                                      resolve_gemm_dtype(config, source), config.quantization)
    per_block = kv_bytes_per_block(model_config, config.cache.block_size, cache_dtype)
    budget = config.cache.kv_cache_memory_bytes
    if budget is None:
        wanted = -(-max_len // config.cache.block_size) * config.scheduler.max_num_seqs * per_block
        budget = min(wanted, hardware.kv_cache_budget(device))
    return max_len, max(1, budget // per_block)


def sim_workload(args: argparse.Namespace, request_rate: float) -> list[SimRequest]:
    """bench serve's requests (same datasets, same seed), tokenized as the engine would, on its send schedule."""
    from twophase.bench.cli import load_requests
    from twophase.bench.datasets import LocalCounter

    counter = LocalCounter(args.tokenizer or args.model)
    samples = load_requests(args, counter)
    if not samples:
        raise ValueError("the workload produced no requests")
    rng = np.random.default_rng(args.seed)
    offsets = send_offsets(arrival_gaps(len(samples), request_rate, args.burstiness, rng), request_rate)
    return [SimRequest(counter.tokenizer.encode(s.prompt), s.expected_output_len, float(o))
            for s, o in zip(samples, offsets)]  # fmt: skip


def load_config(args: argparse.Namespace) -> LoadConfig:
    """bench serve's LoadConfig (traffic and reporting) from the sim flags."""
    metrics = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    unknown = set(metrics) - set(METRIC_NAMES)
    if unknown:
        raise ValueError(f"unknown --percentile-metrics {sorted(unknown)}; use {','.join(METRIC_NAMES)}")
    return LoadConfig(api_url="sim", model=str(args.model), request_rate=args.request_rate,
                      burstiness=args.burstiness, max_concurrency=args.max_concurrency, ignore_eos=True,
                      percentile_metrics=metrics, percentiles=tuple(float(p) for p in args.metric_percentiles.split(",")),
                      goodput=parse_goodput(args.goodput), seed=args.seed, disable_tqdm=True)  # fmt: skip


def simulate(setup: SimSetup, workload: list[SimRequest], max_concurrency: int | None, seed: int) -> SimResult:
    """One simulated run."""
    predictor = ModelPredictor(setup.model, noise=setup.noise, seed=seed)
    jitter = DeliveryJitter(setup.model.jitter_s, setup.model.jitter_corr, seed) if setup.jitter else None
    simulator = Simulator(setup.scheduler, setup.num_blocks, setup.block_size, predictor, setup.gap_s,
                          setup.prefix_caching, admission=setup.admission_s, jitter=jitter,
                          admission_per_stream=setup.admission_per_stream_s)  # fmt: skip
    return simulator.run(workload, max_concurrency)


def cmd_sim(args: argparse.Namespace) -> int:
    """Simulate one run (or a sweep) and print bench serve's result block."""
    setup = sim_setup(args)
    config = load_config(args)
    if args.sweep:
        return run_sim_sweep(args, setup, config)
    result = simulate(setup, sim_workload(args, config.request_rate), config.max_concurrency, args.seed)
    out = build_result(config, result.records, result.duration)
    print(format_result(out, config))
    print(sim_note(setup, result))
    meta = {"backend": "twophase-sim", "label": args.label, "model_id": str(args.model), "num_prompts": args.num_prompts,
            "request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
            "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "simulated": True,
            "num_kv_blocks": setup.num_blocks, "num_steps": len(result.steps),
            "steps_out_of_calibrated_range": result.num_out_of_range,
            "step_time_scale": setup.model.meta.get("scale", 1.0)}  # fmt: skip
    if args.save_result:
        data = result_json(meta, out, args.save_detailed)
        filename = args.result_filename or f"{args.label or 'twophase'}-sim-{args.request_rate}qps-{data['date']}.json"
        print(f"saved {save_json(_jsonable(data), args.result_dir, filename)}")
    return 0


def sim_note(setup: SimSetup, result: SimResult) -> str:
    """One line on how the figures were obtained."""
    report = setup.model.report
    error = f", hold-out error {100 * report.holdout_mean_rel_error:.1f}%" if report else ""
    outside = f"; {result.num_out_of_range} steps outside the calibrated range" if result.num_out_of_range else ""
    scale, steps = setup.model.meta.get("scale"), setup.model.meta.get("rescaled_steps")
    drift, weight = setup.model.meta.get("drift"), setup.model.meta.get("drift_weight", 1.0)
    shrunk = f" x{drift:.3f} weighted {weight:g}" if drift is not None and weight != 1.0 else ""
    rescaled = f", step times x{scale:.3f} (the drift{shrunk} over {steps} recorded steps)" if scale else ""
    return (f"simulated: {len(result.steps)} steps, {setup.num_blocks} KV blocks, gap {setup.gap_s * 1e3:.2f} ms, "
            f"admission {setup.admission_s * 1e3:.1f} ms + {setup.admission_per_stream_s * 1e3:.2f} ms per request "
            f"in flight, noise {'on' if setup.noise else 'off'}, delivery jitter {'on' if setup.jitter else 'off'}"
            f"{error}{rescaled}{outside}")  # fmt: skip


def parse_sim_sweep(items: list[str]) -> list[dict[str, float | str]]:
    """['budget=256,512,auto', 'rate=1,2'] → every combination as {field: value} (a budget may be 'auto')."""
    axes = []
    for item in items:
        key, _, values = item.partition("=")
        if key not in SWEEP_KEYS or not values:
            raise ValueError(f"--sweep takes KEY=V1,V2,... with KEY one of {', '.join(SWEEP_KEYS)}; got {item!r}")
        if key in ("rate", "concurrency") and any(SWEEP_KEYS[a[0]] in ("request_rate", "max_concurrency") for a in axes):
            raise ValueError("--sweep takes rate= or concurrency=, not both")
        axes.append((key, [_sweep_value(key, v) for v in values.split(",")]))
    return [{SWEEP_KEYS[k]: v for (k, _), v in zip(axes, combo)} for combo in itertools.product(*(a[1] for a in axes))]


def _sweep_value(key: str, text: str) -> float | str:
    if key == "budget" and text.strip() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError as exc:
        raise ValueError(f"--sweep {key}= takes numbers{' or auto' if key == 'budget' else ''}, got {text!r}") from exc


def _scheduler_fields(combo: dict[str, float | str]) -> dict[str, Any]:
    """SchedulerConfig fields of a sweep point: a number budget is fixed, 'auto' the SLO-aware policy."""
    fields: dict[str, Any] = {}
    if "max_num_batched_tokens" in combo:
        budget = combo["max_num_batched_tokens"]
        fields = {"step_budget": "auto"} if budget == "auto" else {"step_budget": "fixed",
                                                                   "max_num_batched_tokens": int(budget)}
    if "max_num_seqs" in combo:
        fields["max_num_seqs"] = int(combo["max_num_seqs"])
    return fields


def run_sim_sweep(args: argparse.Namespace, setup: SimSetup, config: LoadConfig) -> int:
    """Every configuration of the grid; the table, then the one with the most goodput at the attainment floor."""
    combos = parse_sim_sweep(args.sweep)
    if not config.goodput:
        raise ValueError("--sweep needs --goodput SLOs to rank configurations")
    if args.sweep_margin < 0:
        raise ValueError(f"--sweep-margin must be at least 0, got {args.sweep_margin}")
    points, workloads = [], {}
    for combo in combos:
        scheduler = dataclasses.replace(setup.scheduler, **_scheduler_fields(combo))
        point_setup = dataclasses.replace(setup, scheduler=scheduler)
        rate = float(combo.get("request_rate", config.request_rate))
        concurrency = int(combo["max_concurrency"]) if "max_concurrency" in combo else config.max_concurrency
        if rate not in workloads:
            workloads[rate] = sim_workload(args, rate)
        point_config = dataclasses.replace(config, request_rate=rate, max_concurrency=concurrency)
        point = _sweep_point(point_setup, point_config, workloads[rate], args.seed)
        if args.sweep_margin:
            slower = dataclasses.replace(point_setup, model=point_setup.model.scaled(1 + args.sweep_margin))
            point["slo_attainment_margin"] = _sweep_point(slower, point_config, workloads[rate], args.seed)[
                "slo_attainment"]  # fmt: skip
        points.append({"config": combo, **point})
    print(format_sim_sweep(points))
    best = best_goodput(points, args.slo_attainment)
    same = same_simulated_run(points, best) if best else []
    verdict = f"{_combo_text(best['config'])} ({best['request_goodput']:.2f} req/s)" if best else "none"
    if same:
        verdict += "; the same simulated run as " + ", ".join(_combo_text(p["config"]) for p in same)
    margin = f" (also with steps {100 * args.sweep_margin:g}% longer)" if args.sweep_margin else ""
    print(f"Most goodput at >= {100 * args.slo_attainment:.0f}% attainment{margin}: {verdict}")
    if args.save_result:
        data = {"backend": "twophase-sim", "model_id": str(args.model), "points": points,
                "best": best and best["config"], "best_same_run": [p["config"] for p in same]}  # fmt: skip
        filename = args.result_filename or f"{args.label or 'twophase'}-sim-sweep.json"
        print(f"saved {save_json(_jsonable(data), args.result_dir, filename)}")
    return 0


def _sweep_point(setup: SimSetup, config: LoadConfig, workload, seed: int) -> dict[str, Any]:
    """One simulated configuration's result block (scalars only)."""
    result = simulate(setup, workload, config.max_concurrency, seed)
    out = build_result(config, result.records, result.duration)
    return {k: v for k, v in out.items() if not isinstance(v, list)}


def best_goodput(points: list[dict[str, Any]], min_attainment: float) -> dict[str, Any] | None:
    """The point with the most request goodput among those whose all-SLO attainment ≥ the floor (and, where the
    point was also simulated with slower steps, ``slo_attainment_margin``, there too)."""
    def qualifies(p: dict[str, Any]) -> bool:
        keys = ("slo_attainment", "slo_attainment_margin") if "slo_attainment_margin" in p else ("slo_attainment",)
        return all(p.get(key, {}).get("all", 0.0) >= min_attainment for key in keys)

    return max(filter(qualifies, points), key=lambda p: p["request_goodput"], default=None)


def same_simulated_run(points: list[dict[str, Any]], best: dict[str, Any]) -> list[dict[str, Any]]:
    """The other points whose simulated result equals ``best``'s in every figure: their settings never acted on this
    workload (e.g. a sequence limit above the most requests ever in flight), so the simulator cannot tell them apart,
    and neither can a measurement beyond its noise."""
    def figures(p: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in p.items() if k != "config"}

    return [p for p in points if p is not best and figures(p) == figures(best)]


def _combo_text(combo: dict[str, float | str]) -> str:
    names = {v: k for k, v in SWEEP_KEYS.items()}
    return " ".join(f"{names[k]}={v if isinstance(v, str) else format(v, 'g')}" for k, v in combo.items())


def format_sim_sweep(points: list[dict[str, Any]]) -> str:
    """One row per configuration: goodput, attainment, throughput, TTFT and TPOT p99."""
    margin = any("slo_attainment_margin" in p for p in points)
    head = (f"{'configuration':<36} {'goodput':>8} {'attain%':>8}{' margin%' if margin else ''} {'req/s':>7} "
            f"{'TTFT p99':>9} {'TPOT p99':>9}")  # fmt: skip
    rows = [head, "-" * len(head)]
    for p in points:
        slower = f" {100 * p['slo_attainment_margin']['all']:>7.1f}" if margin else ""
        rows.append(f"{_combo_text(p['config']):<36} {p['request_goodput']:>8.2f} "
                    f"{100 * p['slo_attainment']['all']:>8.1f}{slower} {p['request_throughput']:>7.2f} "
                    f"{_highest_percentile(p, 'ttft'):>9.1f} {_highest_percentile(p, 'tpot'):>9.1f}")  # fmt: skip
    return "\n".join(rows)


def _highest_percentile(point: dict[str, Any], key: str) -> float:
    """The last reported percentile of a metric (p99 by default)."""
    found = [v for k, v in point.items() if k.startswith("p") and k.endswith(f"_{key}_ms")]
    return float(found[-1]) if found else float("nan")


def _jsonable(data: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(data).replace("Infinity", '"inf"'))
