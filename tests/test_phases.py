"""`bench phases`: analytic intensity (seed 004's numbers), the tables, the JSON and the roofline PNG."""

from __future__ import annotations

import argparse
import json

import pytest

from twophase.bench.phase_timer import SYNTHETIC_CONFIGS, label
from twophase.bench.phases import register_phases
from twophase.bench.roofline import (
    compute_bound_batch,
    decode_floor,
    instruction_peak,
    intensity_of_projection,
    serving_floor,
    step_cost,
    time_floor,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_projection_intensity_reproduces_seed_004():
    # one d×d projection, m rows, 4-byte elements: 2md² FLOPs over weights + input + output activations
    assert intensity_of_projection(2048, 256, 4) == pytest.approx(102.4)
    assert round(intensity_of_projection(2048, 8, 4), 2) == 3.97


def test_step_cost_matches_the_projection_rule_and_grows_with_batch():
    config = SYNTHETIC_CONFIGS["llama-1b"]
    decode = [step_cost(config, 1, 512, b, 2).intensity for b in (1, 8, 64)]
    assert decode == sorted(decode) and decode[0] < 2  # decode at batch 1 is deep in the bandwidth-bound region
    prefill = step_cost(config, 2048, 0, 1, 2)
    linear = 2 * (config.num_params - config.vocab_size * config.hidden_size) * 2048
    assert prefill.flops > linear and prefill.intensity > 100  # prefill is compute-bound
    ridge = 100.0
    batch = compute_bound_batch(config, 512, 2, ridge)
    assert step_cost(config, 1, 512, batch, 2).intensity >= ridge > step_cost(config, 1, 512, batch - 1, 2).intensity


def test_labels_follow_llama_bench():
    assert label("prefill", 512, 0) == "pp512"
    assert label("decode", 128, 0) == "tg128"
    assert label("prefill", 512, 2048) == "pp512 @ d2048"


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    register_phases(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["phases", *argv])
    return args.func(args)


def test_bench_phases_tiny_config_tables_json_and_roofline(tmp_path, capsys):
    out_json, png = tmp_path / "phases.json", tmp_path / "roofline.png"
    # float32 pinned: auto is bfloat16 on an AVX512-BF16 / AMX CPU, which would measure only that dtype's ceiling
    argv = ["--config", "tiny", "--dtype", "float32", "-p", "8,16", "-n", "4", "-b", "1,2", "-d", "8", "-r", "2", "--measure-ceilings",
            "--output-json", str(out_json), "--roofline-png", str(png)]  # fmt: skip
    assert _run(argv) == 0
    text = capsys.readouterr().out
    for needle in ("pp8 @ d8", "pp16 @ d8", "tg4 @ d8", "±", "T_PP s", "S_TG t/s", "ridge point", "compute-bound at"):
        assert needle in text
    result = json.loads(out_json.read_text())
    names = [r["name"] for r in result["results"]]
    assert names == ["pp8 @ d8", "pp16 @ d8", "tg4 @ d8"]
    assert [b["batch"] for b in result["batched"]] == [1, 2]
    for row in result["results"] + [b["decode"] for b in result["batched"]]:
        assert row["tokens_per_s_mean"] > 0 and len(row["seconds"]) == 2
        assert row["intensity"] == pytest.approx(row["flops"] / row["bytes"])
    assert result["results"][0]["mfu"] > 0 and result["results"][2]["bandwidth_utilization"] > 0
    assert result["ceilings"]["bandwidth"] > 0 and result["ceilings"]["matmul_flops"]["float32"] > 0
    batch = result["compute_bound_batch"]  # None where even a 65536-row decode stays below the ridge (fast GEMMs)
    assert batch is None or batch >= 1
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_bench_phases_rejects_a_shape_without_decode_steps():
    with pytest.raises(ValueError):
        _run(["--config", "tiny", "-p", "8", "-n", "0", "-b", "1", "-r", "1"])


def test_floors_take_the_slower_of_compute_and_bytes_a_step():
    config = SYNTHETIC_CONFIGS["llama-1b"]
    prefill, decode = step_cost(config, 512, 0, 1, 2), step_cost(config, 1, 512, 1, 2)
    assert time_floor(prefill, 1e12, 1e11) == prefill.flops / 1e12  # prefill: compute-bound at these ceilings
    assert time_floor(decode, 1e12, 1e11) == decode.bytes / 1e11  # one decode row: bound by its bytes
    # decode steps: one a context length, each at its own floor
    expected = sum(time_floor(step_cost(config, 1, 512 + t, 8, 2), 1e12, 1e11) for t in range(3))
    assert decode_floor(config, 8, 512, 3, 2, 1e12, 1e11) == pytest.approx(expected)


def test_serving_floor_runs_waves_of_the_concurrency():
    config = SYNTHETIC_CONFIGS["llama-1b"]
    one_wave = serving_floor(config, 4, 64, 8, 4, 2, 1e12, 1e11)  # tok/s
    seconds = time_floor(step_cost(config, 64, 0, 4, 2), 1e12, 1e11) + decode_floor(config, 4, 64, 7, 2, 1e12, 1e11)
    assert one_wave == pytest.approx(4 * 8 / seconds)
    # twice the prompts at the same concurrency: two equal waves, the same rate; one at a time: a lower one
    assert serving_floor(config, 8, 64, 8, 4, 2, 1e12, 1e11) == pytest.approx(one_wave)
    assert serving_floor(config, 4, 64, 8, 1, 2, 1e12, 1e11) < one_wave
    # twice the peak and the bandwidth: twice the rate
    assert serving_floor(config, 4, 64, 8, 4, 2, 2e12, 2e11) == pytest.approx(2 * one_wave)


def test_instruction_peak_is_the_best_of_its_tries(monkeypatch):
    """A run the host slowed does not lower the compute floor: the peak is the fastest of ``tries`` runs, each of
    the given length, of the kernels' own measurement."""
    import torch

    from twophase.model.ops import extension

    rates = iter([3.0e11, 4.6e11, 4.1e11])
    calls = []

    class Kernels:
        @staticmethod
        def instruction_peak(name, seconds):
            calls.append((name, seconds))
            return next(rates)

    monkeypatch.setattr(extension, "load_kernels", lambda: Kernels)
    assert instruction_peak(torch.bfloat16, 0.05, tries=3) == 4.6e11
    assert calls == [("bfloat16", 0.05)] * 3
