"""`twophase calibrate`: time real engine steps over a grid of mixes (or read a served run: `/v1/records` dumps
and, optionally, bench serve's results of the same runs) and fit the step-time model the simulator and
`--step-budget auto` use."""

from __future__ import annotations

import json
import logging
import platform
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from twophase.outputs import StepRecord
from twophase.sampling_params import SamplingParams
from twophase.steptime.budget import FixedBudget
from twophase.steptime.features import StepFeatures, record_features
from twophase.steptime.model import StepTimeModel, busy_gap, drift_scale, fit_step_time_model, nnls

log = logging.getLogger(__name__)


def grid_records(engine: Any, budgets: list[int], concurrencies: list[int], prompt_lens: list[int],
                 output_len: int, seed: int = 0, progress: bool = True) -> list[StepRecord]:
    """Run ``concurrency`` random prompts of each length under each fixed budget on a live engine; its steps."""
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    _run_batch(engine, [rng.integers(0, vocab, 32).tolist()], 4)  # warm-up, not recorded
    records: list[StepRecord] = []
    points = [(b, c, p) for b in budgets for c in concurrencies for p in prompt_lens]
    for index, (budget, concurrency, prompt_len) in enumerate(points):
        engine.scheduler.budget_policy = FixedBudget(budget)
        prompt_len = min(prompt_len, engine.max_model_len - output_len - 1)
        first = len(engine.step_records)
        started = time.perf_counter()
        _run_batch(engine, [rng.integers(0, vocab, prompt_len).tolist() for _ in range(concurrency)], output_len)
        records += list(engine.step_records)[first:]
        if progress:
            print(f"[{index + 1}/{len(points)}] budget {budget}, {concurrency} x {prompt_len} prompt tokens: "
                  f"{len(engine.step_records) - first} steps in {time.perf_counter() - started:.1f} s", flush=True)
    return records


def _run_batch(engine: Any, prompts: list[list[int]], output_len: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params, detokenize=False)
    while engine.has_unfinished_requests():
        engine.step()


def records_from_dumps(paths: Iterable[str]) -> tuple[list[StepFeatures], list[float], float]:
    """Features, durations and the busy inter-step gap from `/v1/records` JSON dumps."""
    features, durations, gaps = [], [], []
    for path in paths:
        data = json.loads(Path(path).read_text())
        steps = data.get("steps") if isinstance(data, dict) else None
        if steps is None:
            raise ValueError(f"{path}: not a /v1/records dump (no 'steps')")
        if steps and "prefill_rows" not in steps[0]:
            raise ValueError(f"{path}: its steps carry no step features (recorded by an older twophase)")
        features += [record_features(s) for s in steps]
        durations += [float(s["duration"]) for s in steps]
        gaps.append(busy_gap([s["start_time"] for s in steps], [s["duration"] for s in steps],
                             [s["step_id"] for s in steps]))  # fmt: skip
    return features, durations, float(np.median(gaps)) if gaps else 0.0


def admission_overhead(client_ttfts: Iterable[float], engine_ttfts: Iterable[float]) -> float:
    """The serving overhead outside the engine: the median of client TTFT minus the engine's own TTFT (arrival →
    first token) over paired requests (never negative)."""
    overheads = [c - e for c, e in zip(client_ttfts, engine_ttfts)]
    if not overheads:
        raise ValueError("no request pairs a client TTFT with an engine TTFT")
    return max(0.0, float(np.median(overheads)))


def served_ttft_pairs(paths: Iterable[str]) -> tuple[list[float], list[float]]:
    """(client TTFT, engine TTFT) in seconds of every successful request in bench serve result JSONs saved with
    ``--save-detailed`` against a twophase server (its per-request ``timings`` carry the engine's TTFT)."""
    client, engine = [], []
    for path in paths:
        data = json.loads(Path(path).read_text())
        if "ttfts" not in data or "timings" not in data:
            raise ValueError(f"{path}: not a bench serve result saved with --save-detailed (no ttfts / timings)")
        for ttft, timings, error in zip(data["ttfts"], data["timings"], data.get("errors", [])):
            if not error and ttft and timings and timings.get("ttft_ms") is not None:
                client.append(float(ttft))
                engine.append(float(timings["ttft_ms"]) / 1000)
    if not client:
        raise ValueError(f"no request in {list(paths)} carries server timings (a twophase server sends them)")
    return client, engine


MIN_ADMISSION_PAIRS = 10  # fewer paired requests: the overhead stays the median, independent of load
MAX_JITTER_SAMPLES = 4000  # kept in the model file (evenly spaced quantiles of all the samples)


def delivery_jitter(record_paths: Iterable[str], result_paths: Iterable[str]) -> tuple[list[float], float]:
    """Delivery delays of a served run: for each token after the first, (client receipt − client first token) −
    (engine token time − engine first token), in seconds, and their lag-1 correlation within a request. Each
    `/v1/records` dump is paired with the bench serve result (``--save-detailed``) of the same run, in order; the
    run's requests (first scheduled in the dump's steps) pair in arrival order with the client's in send order,
    and a pair whose prompt or output lengths differ is skipped."""
    delays: list[float] = []
    pairs: list[tuple[float, float]] = []
    for record_path, result_path in zip(record_paths, result_paths):
        result = json.loads(Path(result_path).read_text())
        for request, index in _paired_requests(json.loads(Path(record_path).read_text()), result):
            engine_times, client_itls = request["token_times"], result["itls"][index]
            engine = np.asarray(engine_times) - engine_times[0]  # [n]
            client = np.concatenate([[0.0], np.cumsum(client_itls)])  # [n]
            d = (client - engine)[1:]
            delays += d.tolist()
            pairs += list(zip(d[:-1], d[1:]))
    if len(pairs) < 2:
        return delays, 0.0
    lagged = np.array(pairs)  # [m, 2]
    corr = float(np.corrcoef(lagged[:, 0], lagged[:, 1])[0, 1]) if lagged.std(axis=0).min() > 0 else 0.0
    if len(delays) > MAX_JITTER_SAMPLES:
        delays = np.quantile(delays, np.linspace(0, 1, MAX_JITTER_SAMPLES)).tolist()
    return [round(d, 6) for d in delays], corr


def _paired_requests(dump: dict[str, Any], result: dict[str, Any]) -> Iterable[tuple[dict[str, Any], int]]:
    """(engine request record, index in the client's result) of the requests of one run, paired as
    ``delivery_jitter`` says."""
    steps = dump.get("steps") or []
    if not steps or "itls" not in result:
        return
    first_step = min(s["start_time"] for s in steps)
    engine = sorted((r for r in dump.get("requests", []) if r.get("scheduled") and r.get("token_times")
                     and r["scheduled"][0]["time"] >= first_step), key=lambda r: r["arrival_time"])  # fmt: skip
    errors = result.get("errors") or [""] * len(result["itls"])
    client = [i for i, error in enumerate(errors) if not error]
    for request, index in zip(engine, client):
        if (request["num_prompt_tokens"] == result["input_lens"][index]
                and len(request["token_times"]) == len(result["itls"][index]) + 1):
            yield request, index


def _in_flight_at_arrival(dump: dict[str, Any], request: dict[str, Any]) -> int:
    """How many other requests of the dump were in the engine (arrived, not finished) when ``request`` arrived."""
    t = request["arrival_time"]
    return sum(1 for r in dump.get("requests", []) if r is not request and r["arrival_time"] < t
               and (r.get("finish_time") or float("inf")) > t)  # fmt: skip


def admission_by_load(record_paths: Iterable[str], result_paths: Iterable[str]) -> tuple[float, float, int]:
    """The serving overhead (client TTFT − engine TTFT) as ``base + per_stream × requests in flight`` at each
    request's arrival, fitted by non-negative least squares over the paired requests of served runs (a busy
    server's event loop, streaming other requests' tokens, admits and answers later). (base, per_stream, pairs)."""
    rows, overheads = [], []
    for record_path, result_path in zip(record_paths, result_paths):
        dump, result = json.loads(Path(record_path).read_text()), json.loads(Path(result_path).read_text())
        for request, index in _paired_requests(dump, result):
            engine_ttft = request["token_times"][0] - request["arrival_time"]
            rows.append([1.0, float(_in_flight_at_arrival(dump, request))])
            overheads.append(result["ttfts"][index] - engine_ttft)
    if len(rows) < MIN_ADMISSION_PAIRS:
        return 0.0, 0.0, len(rows)
    base, per_stream = nnls(np.array(rows), np.array(overheads))
    return float(base), float(per_stream), len(rows)


def fit_from_dumps(record_paths: list[str], result_paths: list[str] | None = None) -> StepTimeModel:
    """Step time and the busy gap from a server's `/v1/records` dumps; with the bench serve results of the same
    runs, also the admission overhead and (one result per dump, in the same order) the delivery jitter: a model of
    the engine as served, client included."""
    features, durations, gap = records_from_dumps(record_paths)
    model = fit_step_time_model(features, durations, gap)
    model.meta.update(source=[Path(p).name for p in record_paths])
    if result_paths:
        client, engine = served_ttft_pairs(result_paths)
        model.admission_s = admission_overhead(client, engine)
        if len(result_paths) == len(record_paths):  # one result per dump: the same runs, in order
            model.jitter_s, model.jitter_corr = delivery_jitter(record_paths, result_paths)
            base, per_stream, pairs = admission_by_load(record_paths, result_paths)
            if pairs >= MIN_ADMISSION_PAIRS:
                model.admission_s, model.admission_per_stream_s = base, per_stream
        model.meta.update(served_requests=len(client), served_results=[Path(p).name for p in result_paths])
    return model


def check_drift_weight(weight: float) -> float:
    """``weight`` when it lies in [0, 1] (the share of a measured drift a rescale applies), else ValueError."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"the drift weight must lie in [0, 1], got {weight}")
    return weight


def drift_from_dumps(model: StepTimeModel, record_paths: Iterable[str]) -> tuple[float, int]:
    """(Σ actual ÷ Σ predicted step time by ``model``, steps) over the steps of `/v1/records` dumps."""
    features, durations, _ = records_from_dumps(record_paths)
    return drift_scale(model, features, durations), len(durations)


def rescale_from_dumps(model: StepTimeModel, record_paths: list[str], weight: float = 1.0) -> StepTimeModel:
    """``model`` scaled by the drift (``drift_from_dumps``) over the target server's latest runs, so a prediction
    follows the machine's speed now rather than at calibration. ``weight`` in [0, 1] shrinks the drift toward 1
    (the scale is drift ** weight): a drift measured on other runs also holds the model's error on their mix of
    steps and the host's passing noise, not only a lasting change of speed."""
    drift, steps = drift_from_dumps(model, record_paths)
    scaled = model.scaled(drift ** check_drift_weight(weight))
    scaled.meta.update(rescaled_on=[Path(p).name for p in record_paths], rescaled_steps=steps, drift=drift,
                       drift_weight=weight)
    return scaled


def fit_from_records(records: list[StepRecord], meta: dict[str, Any]) -> StepTimeModel:
    """Fit on engine StepRecords; the gap is the median busy gap between them."""
    gap = busy_gap([r.start_time for r in records], [r.duration for r in records], [r.step_id for r in records])
    model = fit_step_time_model([record_features(r) for r in records], [r.duration for r in records], gap)
    model.meta.update(meta)
    return model


def describe_model(model: StepTimeModel) -> str:
    """The fitted coefficients and the fit's errors, for the terminal."""
    from twophase.steptime.features import FEATURE_NAMES

    units = {"constant": "ms", "prefill_attention_pairs": "ns", "decode_context_tokens": "ns"}
    lines = ["{s:{c}^{n}}".format(s=" Step-time model ", n=50, c="=")]
    for name, value, wide in zip(FEATURE_NAMES, model.coefficients, model.wide_coefficients or model.coefficients):
        unit = units.get(name, "us")
        scale = {"ms": 1e3, "us": 1e6, "ns": 1e9}[unit]
        lines.append("{:<40} {:<10.4f}".format(f"{name} ({unit}):", value * scale))
        if model.rows_split and wide != value:
            lines.append("{:<40} {:<10.4f}".format(f"  from {model.rows_split} rows on:", wide * scale))
    lines.append("{:<40} {:<10.3f}".format("inter-step gap (ms):", model.gap_s * 1e3))
    lines.append("{:<40} {:<10.3f}".format("admission overhead (ms):", model.admission_s * 1e3))
    if model.admission_per_stream_s:
        lines.append("{:<40} {:<10.3f}".format("  + per request in flight (ms):", model.admission_per_stream_s * 1e3))
    if model.jitter_s:
        p10, p90 = np.percentile(model.jitter_s, [10, 90]) * 1e3
        lines.append("{:<40} {:<10}".format("delivery jitter p10 / p90 (ms):", f"{p10:.1f} / {p90:.1f}"))
    if model.report:
        r = model.report
        lines += ["{:<40} {:<10}".format("steps fitted / held out:", f"{r.num_steps} / {r.num_holdout}"),
                  "{:<40} {:<10.2f}".format("mean relative error, fit (%):", 100 * r.train_mean_rel_error),
                  "{:<40} {:<10.2f}".format("mean relative error, hold-out (%):", 100 * r.holdout_mean_rel_error),
                  "{:<40} {:<10.2f}".format("p90 relative error, hold-out (%):", 100 * r.holdout_p90_rel_error)]
        if r.unsplit_train_mean_rel_error is not None:
            lines.append("{:<40} {:<10.2f}".format("  fit error without the split (%):",
                                                   100 * r.unsplit_train_mean_rel_error))
    lines.append("=" * 50)
    return "\n".join(lines)


def engine_meta(engine: Any, grid: dict[str, Any]) -> dict[str, Any]:
    """Where the calibration ran: model, weights, threads, machine, grid, date."""
    import torch

    return {"model": str(engine.config.model), "dtype": str(engine.dtype).removeprefix("torch."),
            "quantization": engine.config.quantization, "threads": torch.get_num_threads(),
            "machine": platform.machine(), "processor": platform.processor(), "num_kv_blocks":
            engine.scheduler.block_manager.num_blocks, "block_size": engine.config.cache.block_size, "grid": grid,
            "date": datetime.now().strftime("%Y%m%d-%H%M%S")}  # fmt: skip
