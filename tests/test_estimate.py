"""`twophase estimate` reproduces the seeds' worked examples exactly."""

from __future__ import annotations

import json

import pytest

from twophase.bench.estimate import estimate, rates_from_phases
from twophase.cli import main


def test_seed_example_long_prompt_short_answer():
    e = estimate(8000, 40, prefill_tok_s=20000, tpot_ms=30)
    assert (e.prefill_ms, e.decode_ms, e.total_ms) == pytest.approx((400.0, 1170.0, 1570.0))
    assert e.decode_tokens == 39 and e.dominant == "decode"


def test_seed_example_short_prompt_long_answer():
    e = estimate(200, 800, prefill_tok_s=5000, tpot_ms=30)
    assert (e.prefill_ms, e.decode_ms, e.total_ms) == pytest.approx((40.0, 23970.0, 24010.0))


def test_seed_example_prefill_time_and_decode_tokens():
    e = estimate(2000, decode_tokens=100, prefill_ms=300, tpot_ms=20)
    assert e.total_ms == pytest.approx(2300.0)
    # the same request stated as output tokens: 101 outputs = the first (from prefill) + 100 decode tokens
    assert estimate(2000, 101, prefill_ms=300, tpot_ms=20).total_ms == pytest.approx(2300.0)


@pytest.mark.parametrize(
    "argv, expected",
    [
        ("--prompt-tokens 8000 --output-tokens 40 --prefill-tok-s 20000 --tpot-ms 30", "0.400 + 1.170 = 1.570 s"),
        ("--prompt-tokens 200 --output-tokens 800 --prefill-tok-s 5000 --tpot-ms 30", "0.040 + 23.970 = 24.010 s"),
        ("--prompt-tokens 2000 --decode-tokens 100 --prefill-ms 300 --tpot-ms 20", "(2,300 ms) — decode dominates"),
    ],
)
def test_cli_prints_the_seed_lines(argv, expected, capsys):
    assert main(["estimate", *argv.split()]) == 0
    assert expected in capsys.readouterr().out


def test_prefill_dominates_when_the_prompt_is_long():
    assert estimate(100_000, 2, prefill_tok_s=1000, tpot_ms=10).dominant == "prefill"


def test_rates_from_a_bench_phases_result(tmp_path, capsys):
    result = {
        "results": [
            {"kind": "prefill", "batch": 1, "tokens_per_seq": 128, "tokens_per_s_mean": 1000.0},
            {"kind": "prefill", "batch": 1, "tokens_per_seq": 2048, "tokens_per_s_mean": 4000.0},
            {"kind": "decode", "batch": 1, "tokens_per_seq": 100, "seconds_mean": 2.0},
        ],
        "batched": [{"batch": 4, "decode": {"tokens_per_seq": 100, "seconds_mean": 3.0}}],
    }
    assert rates_from_phases(result, 1500) == (4000.0, 20.0)
    assert rates_from_phases(result, 100, batch=4) == (1000.0, 30.0)
    path = tmp_path / "phases.json"
    path.write_text(json.dumps(result))
    assert main(["estimate", "--prompt-tokens", "2000", "--output-tokens", "101", "--from-phases", str(path)]) == 0
    assert "0.500 + 2.000 = 2.500 s" in capsys.readouterr().out


def test_bad_inputs_are_one_line_errors(capsys):
    assert main(["estimate", "--prompt-tokens", "10", "--output-tokens", "5", "--tpot-ms", "5"]) == 2
    assert "prefill rate" in capsys.readouterr().err
