"""`twophase calibrate` and `twophase sim` end to end on the tiny model, and `--step-budget auto` in the engine."""

from __future__ import annotations

import json

import pytest

from twophase import LLM, SamplingParams
from twophase.cli import main
from twophase.steptime import FEATURE_NAMES, StepTimeModel


@pytest.fixture(scope="module")
def step_model(tiny_llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("steptime") / "tiny.json"
    code = main(["calibrate", "--model", str(tiny_llama_dir), "--block-size", "4", "--budgets", "16,48",
                 "--concurrency", "1,3", "--prompt-lens", "8,40", "--output-len", "4", "-o", str(path)])
    assert code == 0
    return path


def test_calibrate_writes_a_model_that_predicts_its_steps(step_model):
    model = StepTimeModel.load(step_model)
    assert len(model.coefficients) == len(FEATURE_NAMES) and min(model.coefficients) >= 0
    assert model.report.num_steps >= 20 and model.residual_ratios and model.gap_s >= 0
    assert model.meta["grid"]["budgets"] == [16, 48] and model.meta["block_size"] == 4


def test_calibrate_from_records_dump(step_model, tiny_llama_dir, tmp_path, capsys):
    llm = LLM(str(tiny_llama_dir), progress=False, block_size=4, num_blocks=64, max_num_batched_tokens=16)
    llm.generate([[5] * 30, [7] * 12, [9] * 20], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    from twophase.metrics.records import records_to_json

    dump = tmp_path / "records.json"
    dump.write_text(json.dumps(records_to_json(llm.engine.step_records, [])))
    steps = json.loads(dump.read_text())["steps"]
    assert steps[0]["prefill_rows"] >= 1 and "decode_context_tokens" in steps[0]
    out = tmp_path / "from-records.json"
    assert main(["calibrate", "--model", str(tiny_llama_dir), "--from-records", str(dump), "-o", str(out)]) == 0
    assert StepTimeModel.load(out).meta["source"] == ["records.json"]
    assert "Step-time model" in capsys.readouterr().out


def test_sim_prints_bench_serve_block_and_saves_json(step_model, tiny_llama_dir, tmp_path, capsys):
    args = ["sim", "--model", str(tiny_llama_dir), "--step-time-model", str(step_model), "--block-size", "4",
            "--num-prompts", "12", "--random-input-len", "20", "--random-output-len", "5", "--request-rate", "4",
            "--goodput", "ttft:2000", "tpot:1000", "--save-result", "--result-dir", str(tmp_path),
            "--result-filename", "sim.json", "--metric-percentiles", "50,90,99"]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "Successful requests:                     12" in text
    data = json.loads((tmp_path / "sim.json").read_text())
    assert data["completed"] == 12 and data["total_output_tokens"] == 60 and data["simulated"] is True
    for key in ("median_ttft_ms", "p90_tpot_ms", "p99_itl_ms", "request_goodput", "slo_attainment"):
        assert key in data
    assert main(args) == 0  # deterministic: the same seed gives the same figures
    again = json.loads((tmp_path / "sim.json").read_text())
    assert {k: v for k, v in again.items() if k != "date"} == {k: v for k, v in data.items() if k != "date"}


def test_sim_sweep_picks_a_passing_configuration(step_model, tiny_llama_dir, capsys):
    assert main(["sim", "--model", str(tiny_llama_dir), "--step-time-model", str(step_model), "--block-size", "4",
                 "--num-prompts", "8", "--random-input-len", "20", "--random-output-len", "4", "--goodput",
                 "ttft:100000", "--sweep", "budget=16,48,auto", "concurrency=1,4", "--slo-itl-ms", "50"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert text.count("budget=") >= 7 and "budget=auto concurrency=4" in text
    assert "Most goodput at >= 90% attainment: budget=" in text


def test_sim_sweep_margin_drops_configurations_that_need_an_exact_model(step_model, tiny_llama_dir, tmp_path, capsys):
    argv = ["sim", "--model", str(tiny_llama_dir), "--step-time-model", str(step_model), "--block-size", "4",
            "--num-prompts", "8", "--random-input-len", "20", "--random-output-len", "4", "--request-rate", "50",
            "--goodput", "ttft:1000", "--sweep", "budget=16,48", "--save-result", "--result-dir", str(tmp_path),
            "--result-filename", "sweep.json"]  # fmt: skip
    assert main(argv) == 0
    assert "Most goodput at >= 90% attainment: budget=" in capsys.readouterr().out
    assert main([*argv, "--sweep-margin", "1000"]) == 0  # every step 1,001x longer: TTFTs of seconds
    text = capsys.readouterr().out
    assert "margin%" in text and "(also with steps 100000% longer): none" in text
    points = json.loads((tmp_path / "sweep.json").read_text())["points"]
    assert all(p["slo_attainment"]["all"] >= 0.9 > p["slo_attainment_margin"]["all"] for p in points)


def test_best_goodput_needs_the_floor_with_and_without_the_margin():
    from twophase.sim.cli import best_goodput

    fragile = {"config": {"rate": 2}, "request_goodput": 2.0, "slo_attainment": {"all": 0.95},
               "slo_attainment_margin": {"all": 0.5}}  # fmt: skip
    robust = {"config": {"rate": 1}, "request_goodput": 1.0, "slo_attainment": {"all": 1.0},
              "slo_attainment_margin": {"all": 0.92}}  # fmt: skip
    assert best_goodput([fragile, robust], 0.9) is robust
    unchecked = [{k: v for k, v in p.items() if k != "slo_attainment_margin"} for p in (fragile, robust)]
    assert best_goodput(unchecked, 0.9)["config"] == {"rate": 2}


def test_sweep_names_the_configurations_that_simulate_the_same_run_as_the_pick(step_model, tiny_llama_dir, tmp_path,
                                                                               capsys):  # fmt: skip
    """A sequence limit above the requests ever in flight changes nothing: the pick's line names its twin, and the
    saved result lists it; a limit that binds (1 sequence, 8 requests sent at once) gives another run."""
    argv = ["sim", "--model", str(tiny_llama_dir), "--step-time-model", str(step_model), "--block-size", "4",
            "--num-prompts", "8", "--random-input-len", "20", "--random-output-len", "4", "--goodput", "ttft:100000",
            "--sweep", "max-num-seqs=1,16,32", "--save-result", "--result-dir", str(tmp_path),
            "--result-filename", "sweep.json"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "Most goodput at >= 90% attainment: max-num-seqs=16 " in text
    assert "req/s); the same simulated run as max-num-seqs=32\n" in text
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert saved["best"] == {"max_num_seqs": 16.0} and saved["best_same_run"] == [{"max_num_seqs": 32.0}]
    one, sixteen, _ = saved["points"]
    assert one["max_concurrent_requests"] == 8 and one["p99_ttft_ms"] > sixteen["p99_ttft_ms"]


@pytest.mark.parametrize("argv, message", [
    (["sim"], "needs --step-time-model"),
    (["sim", "--step-time-model", "x.json", "--sweep", "speed=1"], "--sweep takes KEY="),
    (["sim", "--step-time-model", "x.json", "--sweep", "budget=8"], "--sweep needs --goodput"),
    (["sim", "--step-time-model", "x.json", "--sweep", "rate=1", "concurrency=2", "--goodput", "ttft:1"], "not both"),
    (["sim", "--step-time-model", "x.json", "--goodput", "ttfx:1"], "invalid SLO name"),
    (["sim", "--step-time-model", "x.json", "--goodput", "ttft:1", "--sweep", "budget=big"], "numbers or auto"),
    (["sim", "--step-time-model", "x.json", "--goodput", "ttft:1", "--sweep", "budget=auto"], "needs --slo-itl-ms"),
    (["sim", "--step-time-model", "x.json", "--goodput", "ttft:1", "--sweep", "budget=8", "--sweep-margin", "-1"],
     "--sweep-margin must be at least 0"),
    (["serve", "--step-budget", "auto"], "--step-budget auto needs --slo-itl-ms"),
    (["serve", "--slo-itl-headroom", "0"], "--slo-itl-headroom must be in (0, 1]"),
    (["sim", "--step-time-model", "x.json", "--step-time-quantile", "2"], "--step-time-quantile must be in (0, 1]"),
    (["calibrate", "--budgets", "0"], "--budgets takes positive integers"),
])  # fmt: skip
def test_bad_options_end_in_one_line(argv, message, tiny_llama_dir, step_model, capsys):
    argv = [a if a != "x.json" else str(step_model) for a in argv] + ["--model", str(tiny_llama_dir)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_auto_budget_in_the_engine_keeps_tokens_and_records_predictions(step_model, tiny_llama_dir):
    prompts = [[5 + i] * (10 + 7 * i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    fixed = LLM(str(tiny_llama_dir), progress=False, block_size=4, num_blocks=128, max_num_batched_tokens=48,
                dtype="float32")  # fmt: skip
    auto = LLM(str(tiny_llama_dir), progress=False, block_size=4, num_blocks=128, max_num_batched_tokens=48,
               dtype="float32", step_budget="auto", slo_itl_ms=1e-3, step_time_model=str(step_model),
               min_prefill_tokens=3)  # fmt: skip
    want = [o.token_ids for o in fixed.generate(prompts, params)]
    assert [o.token_ids for o in auto.generate(prompts, params)] == want
    steps = list(auto.engine.step_records)
    assert all(s.predicted_duration and s.predicted_duration > 0 for s in steps)
    mixed = [s for s in steps if s.decode_rows and s.num_prompt_tokens]
    assert mixed and all(s.token_budget == s.decode_rows + 3 for s in mixed)  # an ITL no step meets: the floor
    assert max(s.token_budget for s in steps) == 48  # nothing decodes at the start: the cap
