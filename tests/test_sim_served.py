"""The served calibration: the serving overhead (client TTFT minus the engine's) and the busy gap fitted from a
served run's client results and engine records, and the simulator's admission delay."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from twophase.cli import main
from twophase.config import SchedulerConfig
from twophase.metrics.timeline import request_metrics
from twophase.request import RequestTimeline, ScheduledEvent
from twophase.sim import SimRequest, Simulator
from twophase.sim.calibrate import (admission_by_load, admission_overhead, delivery_jitter, fit_from_dumps,
                                   rescale_from_dumps, served_ttft_pairs)
from twophase.sim.simulator import DeliveryJitter, ModelPredictor
from twophase.steptime import FEATURE_NAMES, StepFeatures, StepTimeModel
from twophase.steptime.features import chunk_attention_pairs, record_features
from twophase.steptime.model import drift_scale

COEFFICIENTS = dict(constant=2e-3, prefill_tokens=40e-6, prefill_rows=1e-3, prefill_attention_pairs=2e-8,
                    decode_rows=60e-6, decode_context_tokens=5e-8, sampled_rows=2e-4)  # fmt: skip
GAP_S = 1.5e-3


def linear_model() -> StepTimeModel:
    return StepTimeModel([COEFFICIENTS[n] for n in FEATURE_NAMES])


def synthetic_steps(rng: np.random.Generator, n: int = 400) -> list[dict]:
    """A records dump's steps: durations from the linear model ±3%, a busy gap of GAP_S (±10%) between them."""
    steps, clock = [], 100.0
    for step_id in range(n):
        prefill = int(rng.integers(1, 400)) if step_id % 2 == 0 else 0
        pairs = chunk_attention_pairs(prefill, int(rng.integers(0, 1500))) if prefill else 0
        decode = int(rng.integers(1, 32))
        f = StepFeatures(prefill, int(prefill > 0), pairs, decode, decode * int(rng.integers(50, 900)),
                         int(rng.integers(0, decode + 2)))  # fmt: skip
        duration = linear_model().predict(f) * (1 + rng.normal(0, 0.03))
        steps.append({"step_id": step_id, "start_time": clock, "duration": duration, "num_prompt_tokens": prefill,
                      "prefill_rows": f.prefill_rows, "prefill_attention_pairs": f.prefill_attention_pairs,
                      "decode_rows": decode, "decode_context_tokens": f.decode_context_tokens,
                      "sampled_rows": f.sampled_rows})  # fmt: skip
        clock += duration + GAP_S * (1 + rng.uniform(-0.1, 0.1))
    return steps


def synthetic_served_run(rng: np.random.Generator, send_to_arrival: float, first_token_to_client: float,
                         n: int = 60) -> dict:
    """bench serve's detailed result: each request's engine timeline (random queueing and prefill) and what the
    client saw of it, offset by the overhead on the way in and on the way back (with a little jitter)."""
    ttfts, timings, errors = [], [], []
    for index in range(n):
        send = 10.0 * index
        arrival = send + send_to_arrival * (1 + rng.uniform(-0.2, 0.2))
        scheduled = arrival + rng.uniform(0, 0.3)
        first = scheduled + rng.uniform(0.05, 2.0)
        timeline = RequestTimeline(arrival, [ScheduledEvent(scheduled, 64, True, first)], [first, first + 0.1])
        received = first + first_token_to_client * (1 + rng.uniform(-0.2, 0.2))
        ttfts.append(received - send)
        timings.append({"ttft_ms": 1000 * request_metrics(timeline).ttft})
        errors.append("")
    ttfts.append(0.0), timings.append(None), errors.append("HTTP 500: failed")  # a failed request is left out
    return {"ttfts": ttfts, "timings": timings, "errors": errors}


def test_admission_overhead_is_the_median_difference_and_never_negative():
    assert admission_overhead([0.30, 0.52, 0.41], [0.28, 0.50, 0.30]) == pytest.approx(0.02)
    assert admission_overhead([0.1], [0.2]) == 0.0
    with pytest.raises(ValueError, match="no request"):
        admission_overhead([], [])


def test_fit_served_recovers_step_time_gap_and_overhead(tmp_path):
    rng = np.random.default_rng(11)
    records, result = tmp_path / "records.json", tmp_path / "result.json"
    records.write_text(json.dumps({"schema": "twophase.records.v1", "steps": synthetic_steps(rng), "requests": []}))
    result.write_text(json.dumps(synthetic_served_run(rng, send_to_arrival=0.012, first_token_to_client=0.006)))
    assert len(served_ttft_pairs([str(result)])[0]) == 60
    model = fit_from_dumps([str(records)], [str(result)])
    assert model.admission_s == pytest.approx(0.018, abs=1e-3)
    assert model.gap_s == pytest.approx(GAP_S, rel=0.03)
    for name, want, got in zip(FEATURE_NAMES, linear_model().coefficients, model.coefficients):
        assert abs(got - want) <= 0.15 * want, (name, want, got)
    assert model.meta["served_requests"] == 60
    loaded = StepTimeModel.load(model.save(tmp_path / "m.json"))
    assert loaded.admission_s == model.admission_s and loaded.gap_s == model.gap_s


def test_calibrate_cli_from_a_served_run(tiny_llama_dir, tmp_path, capsys):
    rng = np.random.default_rng(2)
    records, result, out = tmp_path / "records.json", tmp_path / "result.json", tmp_path / "served.json"
    records.write_text(json.dumps({"steps": synthetic_steps(rng, 60), "requests": []}))
    result.write_text(json.dumps(synthetic_served_run(rng, 0.02, 0.0, n=9)))
    argv = ["calibrate", "--model", str(tiny_llama_dir), "--from-records", str(records), "-o", str(out)]
    assert main([*argv, "--served", str(result)]) == 0
    assert "admission overhead (ms):" in capsys.readouterr().out
    assert StepTimeModel.load(out).admission_s == pytest.approx(0.02, abs=3e-3)
    assert main(argv) == 0 and StepTimeModel.load(out).admission_s == 0.0  # records alone: no client side
    assert main(["calibrate", "--model", str(tiny_llama_dir), "--served", str(result), "-o", str(out)]) == 2
    result.write_text(json.dumps({"ttfts": [0.1]}))
    assert main([*argv, "--served", str(result)]) == 2
    assert "--save-detailed" in capsys.readouterr().err


def one_request_run(admission: float, send_offset: float = 0.5):
    config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=256)
    sim = Simulator(config, 64, 16, ModelPredictor(linear_model()), gap=1e-3, admission=admission)
    return sim.run([SimRequest(list(range(3, 90)), 6, send_offset)])


@pytest.mark.parametrize("admission", [0.0, 0.017, 0.25])
def test_admission_shifts_ttft_and_latency_by_exactly_its_value(admission):
    base, delayed = one_request_run(0.0), one_request_run(admission)
    (b,), (d,) = base.records, delayed.records
    assert d.success and d.start_time == b.start_time  # the client sends on its own schedule
    assert math.isclose(d.ttft - b.ttft, admission, rel_tol=0, abs_tol=1e-12)
    assert math.isclose(d.latency - b.latency, admission, rel_tol=0, abs_tol=1e-12)
    assert np.allclose(d.itl, b.itl, rtol=0, atol=1e-12)
    assert delayed.requests[0].timeline.arrival_time == pytest.approx(b.start_time + admission, abs=1e-12)
    assert [s.duration for s in delayed.steps] == [s.duration for s in base.steps]


def test_admission_holds_the_concurrency_slot_and_refusals_still_fail():
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    sim = Simulator(config, 100, 16, ModelPredictor(linear_model()), admission=0.05)
    result = sim.run([SimRequest([1] * 10, 4), SimRequest([2] * 80, 4, 0.001), SimRequest([3] * 10, 4, 0.002)],
                     max_concurrency=1)  # fmt: skip
    assert [r.success for r in result.records] == [True, False, True]
    starts = [r.start_time for r in result.records]
    assert starts[1] >= starts[0] + result.records[0].latency  # sent once the first one finished
    assert starts[2] == pytest.approx(starts[1] + 0.05)  # the refused one held the slot until it reached the engine
    with pytest.raises(ValueError, match="admission"):
        Simulator(config, 100, 16, ModelPredictor(linear_model()), admission=-1.0)


def test_drift_scale_recovers_a_uniform_slowdown_and_scaled_models_predict_it(tmp_path):
    rng = np.random.default_rng(5)
    steps = synthetic_steps(rng, 300)
    for step in steps:  # the machine now runs 18% slower than when the model was fitted
        step["duration"] *= 1.18
    records = tmp_path / "records.json"
    records.write_text(json.dumps({"steps": steps, "requests": []}))
    rescaled = rescale_from_dumps(linear_model(), [str(records)])
    assert rescaled.meta["scale"] == pytest.approx(1.18, rel=0.01) and rescaled.meta["rescaled_steps"] == 300
    f = StepFeatures(100, 1, chunk_attention_pairs(100, 0), 8, 4000, 9)
    assert rescaled.predict(f) == pytest.approx(rescaled.meta["scale"] * linear_model().predict(f))
    assert rescaled.scaled(0.5).meta["scale"] == pytest.approx(0.5 * rescaled.meta["scale"])
    assert rescaled.gap_s == linear_model().gap_s
    halfway = rescale_from_dumps(linear_model(), [str(records)], weight=0.5)  # drift ** 0.5, the drift kept in meta
    assert halfway.meta["scale"] == pytest.approx(rescaled.meta["scale"] ** 0.5)
    assert halfway.meta["drift"] == pytest.approx(rescaled.meta["scale"]) and halfway.meta["drift_weight"] == 0.5
    assert rescale_from_dumps(linear_model(), [str(records)], weight=0.0).meta["scale"] == 1.0
    with pytest.raises(ValueError, match="weight"):
        rescale_from_dumps(linear_model(), [str(records)], weight=1.5)
    with pytest.raises(ValueError, match="positive"):
        linear_model().scaled(0.0)
    with pytest.raises(ValueError, match="no timed step"):
        drift_scale(linear_model(), [StepFeatures()], [0.1])


def test_sim_rescaled_from_records_stretches_every_step(tiny_llama_dir, tmp_path, capsys):
    rng = np.random.default_rng(9)
    steps = synthetic_steps(rng, 80)
    for step in steps:
        step["duration"] = 2.0 * linear_model().predict(record_features(step))  # exactly twice the model
    records, model = tmp_path / "records.json", linear_model().save(tmp_path / "model.json")
    records.write_text(json.dumps({"steps": steps, "requests": []}))
    argv = ["sim", "--model", str(tiny_llama_dir), "--step-time-model", str(model), "--block-size", "4",
            "--num-prompts", "6", "--random-input-len", "20", "--random-output-len", "5", "--request-rate", "inf",
            "--no-noise", "--save-result", "--result-dir", str(tmp_path)]  # fmt: skip
    assert main([*argv, "--result-filename", "plain.json"]) == 0
    assert main([*argv, "--result-filename", "scaled.json", "--rescale-from-records", str(records)]) == 0
    assert "step times x2.000 (the drift over 80 recorded steps)" in capsys.readouterr().out
    assert main([*argv, "--result-filename", "half.json", "--rescale-from-records", str(records),
                 "--rescale-weight", "0.5"]) == 0
    assert "step times x1.414 (the drift x2.000 weighted 0.5 over 80 recorded steps)" in capsys.readouterr().out
    plain, scaled = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("plain", "scaled"))
    assert plain["step_time_scale"] == 1.0 and scaled["step_time_scale"] == pytest.approx(2.0)
    # a burst with no gap or admission: every figure is a sum of step times, so all double
    for key in ("median_ttft_ms", "median_tpot_ms", "p99_itl_ms"):
        assert scaled[key] == pytest.approx(2.0 * plain[key], rel=1e-6), key


def served_pair(rng: np.random.Generator, n: int = 30, base: float = 0.02, per_stream: float = 0.005):
    """A records dump and the bench serve result of the same run: requests overlap (in flight counts 0..3), the
    client's TTFT is the engine's plus ``base + per_stream × in flight``, and each later token reaches the client
    ``delay`` after the engine produced it (relative to the first), ``delay`` cycling through DELAYS."""
    requests, ttfts, itls, input_lens, delays = [], [], [], [], []
    for i in range(n):
        arrival = 1000.0 + 0.5 * i
        tokens = [arrival + 0.1 + 0.05 * k for k in range(8)]
        requests.append({"arrival_time": arrival, "finish_time": arrival + 1.6 + 0.01 * (i % 3),
                         "scheduled": [{"time": arrival + 0.01}], "token_times": tokens,
                         "num_prompt_tokens": 40 + i})  # fmt: skip
    for i, request in enumerate(requests):
        in_flight = sum(1 for r in requests if r["arrival_time"] < request["arrival_time"] < r["finish_time"])
        ttfts.append(request["token_times"][0] - request["arrival_time"] + base + per_stream * in_flight)
        d = [0.0] + [DELAYS[(i + k) % len(DELAYS)] for k in range(7)]
        client = [t + x for t, x in zip(request["token_times"], d)]
        itls.append(np.diff(client).tolist())
        input_lens.append(request["num_prompt_tokens"])
        delays += d[1:]
    rng.shuffle(requests)  # a dump lists requests as they finish; pairing sorts them by arrival
    dump = {"steps": synthetic_steps(rng, 60), "requests": requests}  # steps from t=100 s, before every request
    result = {"ttfts": ttfts, "itls": itls, "input_lens": input_lens, "errors": [""] * n,
              "timings": [{"ttft_ms": 100.0}] * n}  # fmt: skip
    return dump, result, delays


DELAYS = (0.0, 0.03, -0.02, 0.01, 0.05)


def test_served_run_fits_admission_by_load_and_delivery_jitter(tmp_path):
    dump, result, delays = served_pair(np.random.default_rng(4))
    records, results = tmp_path / "records.json", tmp_path / "result.json"
    records.write_text(json.dumps(dump))
    results.write_text(json.dumps(result))
    base, per_stream, pairs = admission_by_load([str(records)], [str(results)])
    assert pairs == 30 and base == pytest.approx(0.02, abs=1e-6) and per_stream == pytest.approx(0.005, abs=1e-6)
    samples, corr = delivery_jitter([str(records)], [str(results)])
    assert sorted(samples) == pytest.approx(sorted(delays), abs=1e-6) and -1.0 <= corr <= 1.0
    model = fit_from_dumps([str(records)], [str(results)])
    assert model.admission_per_stream_s == pytest.approx(0.005, abs=1e-6) and len(model.jitter_s) == 210
    loaded = StepTimeModel.load(model.save(tmp_path / "m.json"))
    assert loaded.jitter_s == model.jitter_s and loaded.admission_per_stream_s == model.admission_per_stream_s
    result["input_lens"] = [n + 1 for n in result["input_lens"]]  # requests that do not pair are left out
    results.write_text(json.dumps(result))
    assert admission_by_load([str(records)], [str(results)])[2] == 0


def test_delivery_jitter_draws_its_samples_correlated_and_keeps_tokens_in_order():
    rng = np.random.default_rng(0)
    samples = rng.normal(0.0, 0.04, 3000).tolist()
    jitter = DeliveryJitter(samples, corr=0.6, seed=1)
    draws = np.concatenate([jitter.draw(200) for _ in range(100)])
    assert set(draws.tolist()) <= set(samples)
    lagged = np.concatenate([(lambda d: np.stack([d[:-1], d[1:]], 1))(jitter.draw(200)) for _ in range(100)])
    assert 0.5 < np.corrcoef(lagged[:, 0], lagged[:, 1])[0, 1] < 0.7
    produced = [0.1 * k for k in range(50)]
    received = jitter.client_times(produced)
    assert received[0] == produced[0] and all(b >= a for a, b in zip(received, received[1:]))
    gaps = np.diff(received)
    assert np.percentile(gaps, 90) > 0.1 + 0.01  # the client's ITL tail spreads beyond the engine's 100 ms
    with pytest.raises(ValueError, match="at least one"):
        DeliveryJitter([], 0.5)


def test_admission_per_stream_delays_each_request_by_the_requests_in_flight():
    config = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=256)
    sim = Simulator(config, 64, 16, ModelPredictor(linear_model()), admission=0.01, admission_per_stream=0.02)
    result = sim.run([SimRequest(list(range(3, 40)), 4, 0.0) for _ in range(3)])  # a burst: 0, 1, 2 in flight
    arrivals = [r.timeline.arrival_time for r in result.requests]
    assert arrivals == pytest.approx([0.01, 0.03, 0.05])
    with pytest.raises(ValueError, match="admission overhead"):
        Simulator(config, 64, 16, ModelPredictor(linear_model()), admission_per_stream=-1.0)
