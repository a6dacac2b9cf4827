"""Simulator, step-time model and SLO-aware budget: oracle replay against the engine, virtual time only,
NNLS recovery, the budget policy's closed form, floor and cap."""

from __future__ import annotations

import dataclasses

import math
import time

import numpy as np
import pytest

from twophase import LLM, SamplingParams
from twophase.bench.metrics import calculate_metrics, send_offsets
from twophase.config import SchedulerConfig
from twophase.request import Request
from twophase.sim import SimRequest, Simulator
from twophase.sim.simulator import ModelPredictor
from twophase.steptime import FEATURE_NAMES, StepFeatures, StepTimeModel, fit_step_time_model, nnls
from twophase.steptime.budget import FixedBudget, SloBudget
from twophase.steptime.features import chunk_attention_pairs, record_features

BLOCK = 4


class Recorder:
    """Wraps a scheduler's ``schedule`` to keep every batch's composition (observation only)."""

    def __init__(self, scheduler) -> None:
        self.batches: list[tuple] = []
        inner = scheduler.schedule

        def schedule():
            out = inner()
            self.batches.append((out.step_id, out.token_budget, tuple(out.preempted_request_ids), tuple(
                (s.request_id, len(s.token_ids), s.start_position, s.is_prompt, s.sample) for s in out.scheduled)))
            return out

        scheduler.schedule = schedule


class Replay:
    """Returns recorded values in order (the oracle's durations and gaps); checks each step's features."""

    def __init__(self, values: list[float], features: list[StepFeatures] | None = None) -> None:
        self.values, self.features, self.index = values, features, 0

    def predict(self, features: StepFeatures) -> float:
        if self.features is not None:
            assert features == self.features[self.index], f"step {self.index}"
        return self.__call__()

    def __call__(self) -> float:
        value = self.values[self.index] if self.index < len(self.values) else 0.0
        self.index += 1
        return value


def scripted_engine_run(tiny_llama_dir):
    """The engine on the tiny model: requests added before given step calls; small KV so it preempts."""
    llm = LLM(str(tiny_llama_dir), progress=False, block_size=BLOCK, num_blocks=10, max_num_batched_tokens=12,
              max_num_seqs=3, dtype="float32")  # fmt: skip
    engine = llm.engine
    recorder = Recorder(engine.scheduler)
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 300, size=8).tolist()
    script = {0: [(shared + [5, 6, 7], 12), (rng.integers(3, 300, size=9).tolist(), 14)],
              2: [(shared + [9, 9], 10)], 3: [(rng.integers(3, 300, size=20).tolist(), 6)],
              9: [(rng.integers(3, 300, size=5).tolist(), 16), (shared + [5, 6, 7], 8)]}  # fmt: skip
    arrivals, step_tokens, call = [], {}, 0
    while script or engine.has_unfinished_requests():
        now = time.monotonic()  # requests of one scripted call arrive together
        for prompt, max_tokens in script.pop(call, []):
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            request = engine.add_request(prompt, params, arrival_time=now)
            arrivals.append((request.request_id, prompt, max_tokens, request.timeline.arrival_time))
        if engine.has_unfinished_requests():
            for output in engine.step():
                step_id = engine.step_records[-1].step_id
                step_tokens.setdefault(output.request_id, []).extend([step_id] * len(output.new_token_ids))
        call += 1
    return engine, recorder, arrivals, step_tokens


def test_oracle_replay_matches_engine_step_for_step(tiny_llama_dir):
    engine, recorder, arrivals, step_tokens = scripted_engine_run(tiny_llama_dir)
    steps = list(engine.step_records)
    assert engine.scheduler.num_preemptions > 0, "the script should force preemptions"
    assert any(s.num_prompt_tokens and s.num_decode_tokens for s in steps)
    durations = [s.duration for s in steps]
    gaps = [b.start_time - (a.start_time + a.duration) for a, b in zip(steps, steps[1:])]
    t0 = steps[0].start_time  # the virtual clock starts where the engine's first step did
    sim = Simulator(engine.scheduler_config, engine.scheduler.block_manager.num_blocks, BLOCK,
                    Replay(durations, [record_features(s) for s in steps]), Replay(gaps), start_time=t0)  # fmt: skip
    sim_recorder = Recorder(sim.scheduler)
    workload = [SimRequest(prompt, n, arrival - t0, rid) for rid, prompt, n, arrival in arrivals]
    result = sim.run(workload)
    assert sim_recorder.batches == recorder.batches
    assert result.step_tokens == step_tokens
    strip = lambda s: {k: v for k, v in s.__dict__.items() if k not in ("start_time", "duration")}  # noqa: E731
    assert [strip(s) for s in result.steps] == [strip(s) for s in steps]
    assert [r.timeline.num_preemptions for r in result.requests] == \
        [len([b for b in recorder.batches if rid in b[2]]) for rid, *_ in arrivals]
    assert np.allclose([s.start_time for s in result.steps], [s.start_time for s in steps], rtol=0, atol=1e-9)
    assert all(r.success and r.output_len == n for r, (_, _, n, _) in zip(result.records, arrivals))


def known_model() -> StepTimeModel:
    # each term a sizeable share of a typical step, so every coefficient is identifiable under 5% noise
    coefficients = dict(constant=2e-3, prefill_tokens=40e-6, prefill_rows=1e-3, prefill_attention_pairs=2e-8,
                        decode_rows=60e-6, decode_context_tokens=5e-8, sampled_rows=2e-4)  # fmt: skip
    return StepTimeModel([coefficients[n] for n in FEATURE_NAMES], residual_ratios=[0.9, 1.0, 1.2])


def workload(n=24, rate=20.0, seed=0) -> list[SimRequest]:
    rng = np.random.default_rng(seed)
    offsets = send_offsets(rng.exponential(1 / rate, size=n), rate)
    return [SimRequest(rng.integers(0, 1000, size=int(rng.integers(20, 200))).tolist(), int(rng.integers(4, 40)), float(o))
            for o in offsets]  # fmt: skip


class Sleepy:
    """A predictor that burns wall time before answering."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def predict(self, features: StepFeatures) -> float:
        time.sleep(0.003)
        return self.inner.predict(features)


@pytest.mark.parametrize("concurrency", [None, 3])
def test_sleeping_predictor_changes_no_figure(concurrency):
    config = SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=8, max_model_len=512)
    runs = []
    for wrap in (lambda p: p, Sleepy):
        sim = Simulator(config, 200, 16, wrap(ModelPredictor(known_model(), noise=True, seed=1)), gap=1e-3)
        result = sim.run(workload(), max_concurrency=concurrency)
        runs.append(calculate_metrics(result.records, result.duration, [50, 90, 99], {"ttft": 50, "tpot": 10}))
        spans = [(r.start_time, r.start_time + r.latency) for r in result.records]
        in_flight = max(sum(a <= s < b for a, b in spans) for s, _ in spans)
        assert in_flight <= (concurrency or 24) and (concurrency is None or in_flight == concurrency)
    assert runs[0] == runs[1]
    assert runs[0]["completed"] == 24 and runs[0]["total_output_tokens"] > 0


def test_nnls_matches_brute_force_on_a_small_problem():
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(30, 3)), rng.normal(size=30)
    x = nnls(a, b)
    assert (x >= 0).all()
    best = min((np.linalg.norm(a[:, list(s)] @ np.clip(np.linalg.lstsq(a[:, list(s)], b, rcond=None)[0], 0, None) - b)
                if s else np.linalg.norm(b)) for s in [(), (0,), (1,), (2,), (0, 1), (0, 2), (1, 2), (0, 1, 2)])
    assert np.linalg.norm(a @ x - b) <= best + 1e-9


def test_fit_recovers_known_coefficients_under_5_percent_noise(tmp_path):
    truth = known_model()
    rng = np.random.default_rng(7)
    features, durations = [], []
    for _ in range(2000):
        rows = int(rng.integers(0, 4))
        chunks = [(int(rng.integers(1, 512)), int(rng.integers(0, 1024))) for _ in range(rows)]
        decode = int(rng.integers(0, 64))
        f = StepFeatures(sum(n for n, _ in chunks), rows, sum(chunk_attention_pairs(n, p) for n, p in chunks), decode,
                         decode * int(rng.integers(1, 2048)), int(rng.integers(0, decode + rows + 1)))  # fmt: skip
        if f.is_empty:
            continue
        features.append(f)
        durations.append(truth.predict(f) * (1 + rng.normal(0, 0.05)))
    model = fit_step_time_model(features, durations, gap_s=1e-3)
    for name, want, got in zip(FEATURE_NAMES, truth.coefficients, model.coefficients):
        assert abs(got - want) <= 0.1 * want, (name, want, got)
    assert model.report.holdout_mean_rel_error < 0.08
    assert 0.8 < float(np.median(model.residual_ratios)) < 1.2
    assert model.rows_split == 0  # a line in the rows: no second regime
    loaded = StepTimeModel.load(model.save(tmp_path / "m.json"))
    assert loaded.coefficients == model.coefficients and loaded.gap_s == 1e-3
    assert loaded.out_of_range(StepFeatures(prefill_tokens=10**6, prefill_rows=1)) == ["prefill_tokens"]
    assert loaded.residual_prefill == [f.prefill_tokens > 0 for f in features]


def test_fit_level_matches_the_sum_of_step_times_under_skewed_noise():
    """Steps spread around the truth by lognormal noise of mean 1 (σ 0.3 in log): a fit on relative error alone would
    predict ~16% low (its scale E[1/n] / E[1/n²] = exp(-0.18)); the fitted steps' predicted seconds sum to their
    measured seconds, and so to the truth's within 3%."""
    truth = known_model()
    rng = np.random.default_rng(5)
    features = [StepFeatures(int(p), int(p > 0), chunk_attention_pairs(int(p), 0), int(d), int(d) * 500, int(d) + 1)
                for p, d in zip(rng.integers(0, 512, 3000), rng.integers(1, 48, 3000))]  # fmt: skip
    noise = np.exp(rng.normal(-0.045, 0.3, len(features)))  # [m], mean 1
    durations = [truth.predict(f) * n for f, n in zip(features, noise)]
    model = fit_step_time_model(features, durations)
    predicted = sum(model.predict(f) for f in features)
    assert abs(predicted / sum(durations) - 1) < 1e-6
    assert abs(predicted / sum(truth.predict(f) for f in features) - 1) < 0.03


def test_fit_finds_the_row_count_where_step_time_drops(tmp_path):
    """An engine whose kernels switch at 8 rows: decode steps of 1-7 rows cost 5 ms + 3 ms a row, from 8 rows on
    9 ms + 1 ms a row (7 rows 26 ms, 8 rows 17 ms), 5% noise. The fit keeps a second regime from 8 rows, recovers
    both within 10%, and the saved file keeps it; one line through both sides fits half as well."""
    rng = np.random.default_rng(11)
    features, durations = [], []
    for _ in range(1500):
        decode = int(rng.integers(1, 33))
        prompt = int(rng.integers(64, 512)) if rng.random() < 0.2 else 0
        f = StepFeatures(prompt, int(prompt > 0), chunk_attention_pairs(prompt, 0), decode, decode * 300, decode)
        rows = prompt + decode
        truth = (5e-3 + 3e-3 * decode if rows < 8 else 9e-3 + 1e-3 * decode) + 1e-4 * prompt
        features.append(f)
        durations.append(truth * (1 + rng.normal(0, 0.05)))
    model = fit_step_time_model(features, durations)
    assert model.rows_split == 8
    assert model.report.unsplit_train_mean_rel_error > 1.5 * model.report.train_mean_rel_error
    assert model.report.holdout_mean_rel_error < 0.08
    for rows, want in [(1, 8e-3), (7, 26e-3), (8, 17e-3), (32, 41e-3)]:
        got = model.predict(StepFeatures(decode_rows=rows, decode_context_tokens=rows * 300, sampled_rows=rows))
        assert abs(got - want) <= 0.1 * want, (rows, want, got)
    loaded = StepTimeModel.load(model.save(tmp_path / "split.json"))
    assert (loaded.rows_split, loaded.wide_coefficients) == (8, model.wide_coefficients)
    assert loaded.scaled(2.0).predict(StepFeatures(decode_rows=8)) == 2 * loaded.predict(StepFeatures(decode_rows=8))


def test_noise_draws_residuals_of_the_same_step_kind():
    # decode-only steps varied by x1.5 in calibration, steps with prompt tokens by x1.1: each kind keeps its own
    ratios, kinds = [1.5] * 30 + [1.1] * 25, [False] * 30 + [True] * 25
    model = dataclasses.replace(known_model(), residual_ratios=ratios, residual_prefill=kinds)
    predictor = ModelPredictor(model, noise=True, seed=3)
    decode, prefill = StepFeatures(decode_rows=4, decode_context_tokens=400), StepFeatures(64, 1, 2080)
    assert {round(predictor.predict(decode) / model.predict(decode), 6) for _ in range(50)} == {1.5}
    assert {round(predictor.predict(prefill) / model.predict(prefill), 6) for _ in range(50)} == {1.1}
    few = dataclasses.replace(model, residual_prefill=[False] * 50 + [True] * 5)  # too few of a kind: draw from all
    drawing_all = ModelPredictor(few, noise=True)
    assert {round(drawing_all.predict(prefill) / model.predict(prefill), 6) for _ in range(200)} == {1.5, 1.1}
    unknown = dataclasses.replace(model, residual_prefill=[])  # a model file from before the kinds: all of them
    assert unknown.residuals_of_kind(True) == ratios


def decoding(rid: str, context: int) -> Request:
    r = Request(rid, list(range(context - 1)), SamplingParams(max_tokens=100))
    r.output_token_ids.append(1)
    r.num_computed_tokens = r.num_tokens - 1
    return r


def test_budget_policy_closed_form_floor_and_cap():
    coefficients = dict.fromkeys(FEATURE_NAMES, 0.0)
    coefficients.update(constant=2e-3, prefill_tokens=50e-6, decode_rows=100e-6)
    linear = StepTimeModel([coefficients[n] for n in FEATURE_NAMES])
    running = [decoding(f"d{i}", 100) for i in range(10)]
    waiting = [Request("w", list(range(3000)), SamplingParams(max_tokens=4))]
    policy = SloBudget(linear, itl_s=0.05, cap=4096, floor=32, headroom=1.0)  # ratio 1: nothing observed yet
    # 50 ms = 2 ms + 10 × 0.1 ms + n × 50 µs → n = 940
    assert policy.step_budget(running, waiting) == 10 + 940
    assert policy.step_budget(running, []) == 4096  # no prompt to fill the step with
    assert policy.step_budget([], waiting) == 4096  # nothing decodes: the cap
    assert SloBudget(linear, itl_s=0.004, cap=4096, floor=32).step_budget(running, waiting) == 10 + 32  # the floor
    assert SloBudget(linear, itl_s=0.05, cap=512, floor=32).step_budget(running, waiting) == 512
    # the default headroom aims at 90% of the objective: 45 ms = 3 ms + n × 50 µs → n = 840
    assert SloBudget(linear, itl_s=0.05, cap=4096, floor=32).step_budget(running, waiting) == 10 + 840
    # quadratic (causal pairs from position 0): the largest n with predict ≤ ITL
    coefficients.update(prefill_attention_pairs=2e-8)
    quadratic = SloBudget(StepTimeModel([coefficients[n] for n in FEATURE_NAMES]), itl_s=0.05, cap=4096, floor=1,
                          headroom=1.0)
    chunk = quadratic.step_budget(running, waiting) - 10
    base = StepFeatures(decode_rows=10, decode_context_tokens=1000, sampled_rows=10)
    step = lambda n: quadratic.model.predict(StepFeatures(n, 1, chunk_attention_pairs(n, 0), 10, 1000, 11))  # noqa: E731
    assert step(chunk) <= 0.05 < step(chunk + 1) and quadratic.largest_chunk(base, 0) == chunk
    # steps running twice as slow as predicted shrink the chunk (every ratio 2: its quantile is 2)
    for _ in range(50):
        policy.observe(0.01, 0.02)
    assert policy.ratio == 2.0
    assert policy.step_budget(running, waiting) == 10 + math.floor((0.05 / policy.ratio - 3e-3) / 50e-6)
    assert FixedBudget(256).step_budget(running, waiting) == 256


def test_budget_policy_solves_each_regime_of_a_split_model():
    """With a second regime from 64 rows the chunk comes from the regime the whole step falls in: the wide
    regime's when its solution keeps the step at 64 rows or more, else the narrow one's, kept below 64 rows."""
    names = list(FEATURE_NAMES)

    def coefficients(**values: float) -> list[float]:
        return [values.get(n, 0.0) for n in names]

    narrow = coefficients(constant=2e-3, prefill_tokens=50e-6, decode_rows=100e-6)
    running = [decoding(f"d{i}", 100) for i in range(10)]
    waiting = [Request("w", list(range(3000)), SamplingParams(max_tokens=4))]
    base = StepFeatures(decode_rows=10, decode_context_tokens=1000, sampled_rows=10)
    cheap = coefficients(constant=5e-3, prefill_tokens=50e-6)
    cheap_wide = StepTimeModel(narrow, rows_split=64, wide_coefficients=cheap)
    # wide: 50 ms = 5 ms + n × 50 µs → n = 900, a step of 910 rows: wide
    assert SloBudget(cheap_wide, itl_s=0.05, cap=4096, floor=1, headroom=1.0).largest_chunk(base, 0) == 900
    costly = coefficients(constant=49e-3, prefill_tokens=50e-6)
    costly_wide = StepTimeModel(narrow, rows_split=64, wide_coefficients=costly)
    # wide: 50 ms = 49 ms + n × 50 µs → n = 20 leaves the step at 30 rows, not wide; narrow: n = 940, kept at 53
    assert SloBudget(costly_wide, itl_s=0.05, cap=4096, floor=1, headroom=1.0).largest_chunk(base, 0) == 53
    assert SloBudget(costly_wide, itl_s=0.05, cap=4096, floor=1, headroom=1.0).step_budget(running, waiting) == 63


def test_auto_budget_in_simulation_keeps_mixed_steps_within_itl_unlike_a_large_fixed_budget():
    model = known_model()
    itl = 0.03
    rng = np.random.default_rng(5)
    load = [SimRequest(rng.integers(0, 1000, size=900).tolist() if i % 3 == 0 else [i] * 20, 40, 0.02 * i)
            for i in range(30)]  # long prompts arriving among many short streams
    runs = {}
    for name, policy in (("fixed", FixedBudget(2048)), ("auto", SloBudget(model, itl, cap=2048, floor=16, max_num_seqs=32))):
        config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=32, max_model_len=2048)
        sim = Simulator(config, 4000, 16, ModelPredictor(model), gap=0.0, budget_policy=policy)
        runs[name] = sim.run(load)
        assert all(r.success for r in runs[name].records) and len(runs[name].records) == 31 - 1
    mixed = lambda run: [s for s in run.steps if s.decode_rows and s.num_prompt_tokens]  # noqa: E731
    assert any(s.duration > itl for s in mixed(runs["fixed"]))
    assert mixed(runs["auto"]) and all(s.duration <= itl or s.num_prompt_tokens <= 16 for s in mixed(runs["auto"]))
    assert all(s.predicted_duration == s.duration for s in runs["auto"].steps)  # no noise: ratio stays 1


def test_refused_request_fails_like_in_bench_serve():
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    result = Simulator(config, 100, 16, ModelPredictor(known_model())).run(
        [SimRequest([1] * 10, 4), SimRequest([2] * 80, 4, 0.001), SimRequest([3] * 10, 4, 0.002)])
    assert [r.success for r in result.records] == [True, False, True]
    assert "context length" in result.requests[1].timeline.finish_reason


class EverySecond:
    """A predictor for which every step takes one second."""

    def predict(self, features: StepFeatures) -> float:
        return 1.0


@pytest.mark.parametrize("concurrency", [None, 1])
def test_a_request_sent_during_a_step_waits_for_it_from_its_send_time(concurrency):
    # A's prompt step runs 0..1 s; B is sent at 0.25 s, inside it. The engine takes B at the next step (1..2 s), and
    # B's client-side TTFT runs from its send, as bench serve measures it: 1.75 s, not the 1 s of a send at 1 s.
    # With one request at a time, B is sent only when A has ended (at 2 s, its second token), and waits no step.
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    sim = Simulator(config, 100, 16, EverySecond(), gap=0.0)
    a, b = sim.run([SimRequest([1] * 10, 2), SimRequest([2] * 10, 2, 0.25)], max_concurrency=concurrency).records
    assert a.start_time == 0.0 and a.ttft == pytest.approx(1.0) and a.latency == pytest.approx(2.0)
    if concurrency is None:
        assert b.start_time == pytest.approx(0.25) and b.ttft == pytest.approx(1.75) and b.latency == pytest.approx(2.75)
    else:
        assert b.start_time == pytest.approx(2.0) and b.ttft == pytest.approx(1.0) and b.latency == pytest.approx(2.0)
