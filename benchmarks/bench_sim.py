"""Accuracy and value of the calibrated simulator and the SLO-aware step budget (issue 11), end to end.

Stages (each saves its JSON under ``--out``; ``results.md`` sums them up):

1. **calibrate** — by default a served calibration: one ``twophase serve`` driven by ``bench serve`` as the
   accuracy points are (a saturated burst of the mixed workload, then mixed at 50% and 90%, decode-heavy at 70%,
   prefill-heavy at 60% and a calibration-only long-context workload at 60% of their simulated capacities, seeds
   no accuracy point uses); its ``/v1/records``
   after each run and bench serve's results go to ``twophase calibrate --from-records ... --served ...``, so step
   times, the busy inter-step gap and the per-request serving overhead (``admission_s``: client TTFT minus the
   engine's) are those of the engine as served, client beside it. ``--calibration grid``: ``twophase calibrate``
   over a grid of step mixes on the engine alone; ``--steptime FILE`` reuses a model. Either way the step-time
   model never sees the runs it predicts.
2. **accuracy** — four workloads (decode-heavy 64 in / 256 out, prefill-heavy 1024 / 16, mixed 256 / 128 with
   lengths ±50%, shared-prefix: bench serve's prefix-repetition, 4 prefixes of 512 + 64-token suffixes / 64 out).
   Capacity (req/s) of each is the *simulated* request throughput with every request sent at once
   (``--request-rate inf``, ``--capacity measured`` measures it instead); loads are 30 / 60 / 85% of it as Poisson
   rates. Per point, one ``twophase serve`` per workload and repeat (reused across its loads; every load has its
   own seed, so no prompt of one load is in the prefix cache of the next) is driven by ``twophase bench serve``
   with a fixed seed and number of prompts, and ``twophase sim`` gets the same workload and engine flags. The
   request lists are checked identical before the run (same prompt texts, token ids as the server encodes them,
   output lengths, send offsets) and after it (the server's ``usage.prompt_tokens`` against the simulator's prompt
   lengths).
   TTFT, TPOT and ITL p50/p90/p99 and goodput are compared against the issue's tolerances (p50/p90 within 15%,
   p99 within 25%, goodput within 15%). ``--measured-repeats N`` measures every point N times (repeat r of every
   load of a workload on a fresh server of its own, so loads interleave and each repeat starts with a cold prefix
   cache, minutes apart) and compares the simulator with the per-figure median of the N runs; ``results.md`` then
   shows each figure's measured min..max and flags (†) the figures whose runs spread beyond the tolerance around
   their median, where machine noise alone exceeds it. The default, 1, keeps the run time; the issue's accuracy
   claim should use 3 (one measured run on a shared 2-core machine varies by 12-52% in TPOT between repeats).
   ``--resimulate DIR --steptime FILE`` compares a saved accuracy stage's measured runs (DIR: its ``--out``)
   with new simulations under another step-time model or drift setting, serving nothing: a change to the
   model is judged on the same measured runs, free of the host's drift between benchmark runs.
   Goodput SLOs per workload: TTFT 5x and TPOT 3x the step-time model's unloaded figures (one request alone: its
   prefill steps; one decode step plus the gap) — loose at 30% load, binding near capacity, so goodput is neither
   trivially all nor nothing.
3. **sweep** — ``twophase sim --sweep budget=... max-num-seqs=... rate=...`` on the mixed workload at 40% and 55%
   of its capacity (one request list of at least ``--sweep-prompts`` requests, 40 by default, sent at either
   rate) picks the configuration with the most goodput at >= 90% attainment (``--sweep-margin F``: also with every
   step F longer); every configuration is then measured (``--sweep-repeats N``: N times, the configurations
   interleaved, compared by the medians); the pick passes when its measured goodput is within 5% of the best
   measured one (the issue's check), and the stricter check when it also reaches 90% attainment measured and is
   within 5% of the best measured configuration that does. The loads straddle the goodput cliff of the workload's
   SLOs: at 30% every configuration meets them, at 60% and above none reaches 90% attainment (session 18 swept at
   85% alone, where nothing could be picked), so the rate axis asks how much load a configuration takes within the
   SLOs.
4. **auto** — streams (short prompts, long outputs) alternating with long-prompt arrivals (pattern S S S L, a
   custom JSONL dataset), served with fixed budgets 512 and 2048 and with ``--step-budget auto --slo-itl-ms X
   --slo-ttft-ms Y`` (cap 2048), interleaved (512, 2048, auto, repeat), a fresh server per run, medians of
   ``--runs``. A request is good when its TTFT <= Y and its largest inter-token gap <= X * (1 + ``--itl-slack``)
   (the slack, 25% by default, is room for step-time noise the policy cannot foresee; the issue's p99 tolerance).
   Auto runs with the engine's defaults for the noise it can foresee: each chunk sized for the p90 of recent
   actual/predicted step times (``--step-time-quantile``) at 90% of X (``--slo-itl-headroom``).

   How X and Y are chosen (from the calibrated model, so they fit the machine; ``--auto-itl-ms`` /
   ``--auto-ttft-ms`` override): X = half the predicted duration of a 512-token prefill step beside a few decode
   rows (at least 3 decode steps of 8 rows), Y = 2.5x the predicted prefill of one long prompt alone at budget
   2048. On the 2-core CPU with the default model a decode step of 8 rows takes ~60-100 ms and prefill runs at
   ~350 tok/s, so a 512-token chunk stalls every stream for ~1.5 s and a 2048-token step for ~4.5 s: X ~ 0.75 s is
   an ITL objective neither fixed budget can meet whenever a long prompt arrives, while auto's chunks (~200 tokens)
   can; Y ~ 11 s leaves room for the extra steps auto's smaller chunks take. Note that on this CPU step time is
   nearly linear in tokens with a small fixed cost, so TTFT and (mean per request) TPOT barely depend on the budget
   above ~100 tokens (prefill work is conserved); the budget-512 failure of the issue's GPU picture (TTFT) does not
   arise here. Both fixed budgets miss the ITL objective and meet TTFT; auto trades some TTFT for meeting ITL.

Request lists: ``bench serve`` runs with ``--tokenizer`` (the model), ``--ignore-eos`` (the simulator always
ignores EOS) and ``--ready-check-timeout-sec 0`` (its initial test request would put request 0's prompt in the
prefix cache before the run; each server is warmed up with an unrelated prompt instead); ``--kv-cache-memory`` is
explicit, so the simulator sizes the KV cache exactly as the server does. ``sim`` and ``bench serve`` run in this
process (``twophase.cli.main``), ``calibrate`` and ``serve`` as subprocesses.

Commands (the default model, float32, CPU, 2 cores: about 40 min in all, of which calibration ~5 min and the 12
accuracy points ~13 min; ``--quick`` ~15 min; ``--smoke`` ~3 min)::

    python benchmarks/bench_sim.py --out runs/bench-sim                       # everything
    python benchmarks/bench_sim.py --quick --out runs/bench-sim-quick          # fewer, shorter points
    python benchmarks/bench_sim.py --only auto --steptime runs/bench-sim/steptime.json
    python benchmarks/bench_sim.py --only accuracy --workloads mixed --loads 0.6 --steptime runs/bench-sim/steptime.json
    python benchmarks/bench_sim.py --measured-repeats 3 --out runs/bench-sim   # the accuracy claim (~30 min more)
    python benchmarks/bench_sim.py --smoke                                    # tiny random model: the wiring
    python benchmarks/bench_sim.py --resimulate runs/bench-sim --steptime M.json --out runs/resim  # no serving
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import math
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from bench_disagg import Proc  # noqa: E402

SERVED_NAME = "bench"
PERCENTILES = ("p50", "p90", "p99")
TOLERANCE = {"p50": 0.15, "p90": 0.15, "p99": 0.25, "goodput": 0.15}
SWEEP_PICK_TOLERANCE = 0.05
SWEEP_ATTAINMENT = 0.9  # a configuration qualifies at >= 90% all-SLO attainment (the simulator's --slo-attainment)


# ---------------------------------------------------------------- configuration


@dataclass
class Workload:
    """One accuracy workload: its bench serve / sim flags and the mean lengths the SLOs are set from."""

    name: str
    flags: list[str]
    input_len: int
    output_len: int
    prompt_multiple: int = 1  # prefix-repetition needs num_prompts % num_prefixes == 0


@dataclass
class AutoTest:
    """The auto-vs-fixed workload: streams (S) and long prompts (L) in a repeating pattern, Poisson arrivals."""

    stream_in: int = 64
    stream_out: int = 192
    long_in: int = 1536
    long_out: int = 16
    pattern: str = "SSSL"
    rate: float = 0.3
    num_prompts: int = 12
    runs: int = 3
    budgets: tuple[int, int] = (512, 2048)
    itl_ms: float | None = None  # None: from the step-time model (module docstring)
    ttft_ms: float | None = None
    itl_slack: float = 0.25


@dataclass
class ServedCalibration:
    """The served calibration's traffic: a saturated burst of the first run's workload (a provisional model, and
    from it the simulated capacities), then each (workload, fraction of its capacity) for ``seconds`` of Poisson
    arrivals. Seeds differ from every accuracy point's, so no predicted request list is calibrated on."""

    burst_prompts: int = 16  # at least; raised to the sweep's largest max-num-seqs (see calibration_burst)
    seconds: float = 30.0
    runs: tuple[tuple[str, float], ...] = (("mixed", 0.5), ("mixed", 0.9), ("decode-heavy", 0.7),
                                           ("prefill-heavy", 0.6), ("long-context", 0.6))  # fmt: skip
    seed_offset: int = 7000
    workloads: list[Workload] = field(default_factory=lambda: calibration_workloads())  # runs may name these too


@dataclass
class Profile:
    """Everything a run needs: the engine, the run lengths, the grid, the workloads."""

    model: str
    dtype: str = "auto"  # what `twophase serve` runs by default (bfloat16 on AVX512-BF16 / AMX CPUs)
    max_model_len: int = 2048
    max_num_seqs: int = 64
    budget: int = 512
    kv_cache_memory: str = "4GiB"
    threads: int | None = None
    seconds: float = 40.0  # arrival window of one measured point
    min_prompts: int = 6
    loads: tuple[float, ...] = (0.3, 0.6, 0.85)
    capacity_prompts: int = 96
    capacity: str = "sim"
    calibrate: list[str] = field(default_factory=lambda: [
        "--budgets", "128,2048", "--concurrency", "1,8,32", "--prompt-lens", "32,1024", "--output-len", "32"])
    calibration: str = "served"  # "served": a loaded server's records + bench serve's results; "grid": the engine
    served: ServedCalibration = field(default_factory=lambda: ServedCalibration())
    sweep: list[str] = field(default_factory=lambda: ["budget=128,2048", "max-num-seqs=8,32"])
    sweep_workload: str = "mixed"
    sweep_loads: tuple[float, ...] = (0.4, 0.55)  # fractions of the workload's capacity: the sweep's rate axis
    sweep_margin: float = 0.0  # > 0: the pick must also reach the attainment floor with every step this much longer
    sweep_repeats: int = 1  # measured runs per sweep configuration (interleaved), compared by their medians
    # requests in the sweep's request list, at least: goodput counts requests, so with n of them one request that
    # misses an objective moves a configuration's goodput by 1/n. At 40 that is 2.5%, half the check's 5% tolerance;
    # the 15 that 40 s of arrivals gave before made one request 6.7%, more than the tolerance itself.
    sweep_min_prompts: int = 40
    seed: int = 0
    auto: AutoTest = field(default_factory=AutoTest)
    workloads: list[Workload] = field(default_factory=list)
    accuracy_workloads: tuple[str, ...] = ()  # a subset of the workloads' names for the accuracy stage (() = all)
    measured_repeats: int = 1  # measured runs per accuracy point, compared by their per-figure median
    probe_prompts: int = 8  # accuracy: a burst of this many requests warms each server; 0: none
    rescale: bool = True  # accuracy: also simulate each run with the model rescaled on earlier runs (drift)
    drift_window: str = "server"  # rescale on the server's earlier runs, the one before ("previous") or itself ("own")
    # the rescale is drift ** drift_weight: shrunk halfway toward 1. On three accuracy runs (sessions 27-28, 36
    # points), drift ** 0.5 predicted each point's own actual / predicted step time with a mean |log error| of 5.6%,
    # the whole drift 6.8%, none 6.6%; figures within tolerance 82 / 75 / 81 of 120 against 65 / 68 / 80 (whole
    # drift) and 87 / 73 / 64 (none). Chosen on those runs, not tested on others.
    drift_weight: float = 0.5
    sim_args: list[str] = field(default_factory=list)  # accuracy: more `twophase sim` flags for every point

    def engine_flags(self, **overrides: Any) -> list[str]:
        """The engine flags serve and sim share (``budget`` / ``max_num_seqs`` overridable)."""
        values = {"budget": self.budget, "max_num_seqs": self.max_num_seqs, **overrides}
        flags = ["--dtype", self.dtype, "--max-model-len", str(self.max_model_len), "--block-size", "16",
                 "--kv-cache-memory", self.kv_cache_memory, "--max-num-seqs", str(values["max_num_seqs"]),
                 "--max-num-batched-tokens", str(values["budget"])]  # fmt: skip
        return flags + (["--threads", str(self.threads)] if self.threads else [])


def random_flags(input_len: int, output_len: int, range_ratio: float = 0.0) -> list[str]:
    """bench serve's random dataset."""
    return ["--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len",
            str(output_len), "--random-range-ratio", str(range_ratio)]  # fmt: skip


def prefix_flags(prefix: int, suffix: int, output_len: int, num_prefixes: int) -> list[str]:
    """bench serve's prefix-repetition dataset."""
    return ["--dataset-name", "prefix-repetition", "--prefix-repetition-prefix-len", str(prefix),
            "--prefix-repetition-suffix-len", str(suffix), "--prefix-repetition-output-len", str(output_len),
            "--prefix-repetition-num-prefixes", str(num_prefixes)]  # fmt: skip


def scaled_length(n: int, scale: float) -> int:
    """A workload length shrunk by ``scale`` (the smoke run's tiny model), at least 2."""
    return max(2, int(n * scale))


def default_workloads(scale: float = 1.0) -> list[Workload]:
    """The four accuracy workloads; ``scale`` shrinks every length (the smoke run's tiny model)."""
    s = functools.partial(scaled_length, scale=scale)
    return [
        Workload("decode-heavy", random_flags(s(64), s(256)), s(64), s(256)),
        Workload("prefill-heavy", random_flags(s(1024), s(16)), s(1024), s(16)),
        Workload("mixed", random_flags(s(256), s(128), 0.5), s(256), s(128)),
        Workload("shared-prefix", prefix_flags(s(512), s(64), s(64), 4), s(512) + s(64), s(64), 4),
    ]


def calibration_workloads(scale: float = 1.0) -> list[Workload]:
    """Workloads the served calibration runs besides the accuracy ones, none of which it predicts.
    ``long-context``: decode rows over 384-1,440 tokens of context each (distinct prompts, 768 / 192 ±50%), so that
    the fit can tell a context token's cost from a decode row's. The accuracy workloads' runs decode over 64-640
    tokens, and there the rows and the context rise together. Session 31's fit without this run (2 Zen 3 cores)
    charged 5.8 µs a context token and 1.0 ms a decode row (beyond 4 rows). On session 31's second accuracy run,
    decode-only steps of 5-24 rows then ran x1.02-1.19 of the prediction over ~190 tokens of context a row, and
    x0.75-0.84 over 610-1,030 tokens. Session 32's calibration gave 2.8 µs and 1.9 ms without this run, and 1.3 µs and
    2.3 ms with it. On three measured accuracy runs the figures within tolerance stayed the same within noise
    (docs/runs/sim-cpu, session 32)."""
    prompt, output = scaled_length(768, scale), scaled_length(192, scale)
    return [Workload("long-context", random_flags(prompt, output, 0.5), prompt, output)]


def make_profile(args: argparse.Namespace) -> Profile:
    """The profile the flags ask for (full, quick or smoke)."""
    profile = Profile(model=args.model, dtype=args.dtype, threads=args.threads, capacity=args.capacity,
                      seed=args.seed, workloads=default_workloads(), calibration=args.calibration)  # fmt: skip
    if args.quick:
        profile.seconds, profile.loads, profile.capacity_prompts = 20.0, (0.3, 0.85), 64
        profile.calibrate = ["--budgets", "256,2048", "--concurrency", "1,16", "--prompt-lens", "32,1024",
                             "--output-len", "24"]  # fmt: skip
        profile.sweep = ["budget=512", "max-num-seqs=8,32"]
        profile.auto = dataclasses.replace(profile.auto, runs=1)
    if args.smoke:
        smoke_profile(profile)
    if args.runs:
        profile.auto.runs = args.runs
    if args.workloads:
        profile.accuracy_workloads = tuple(args.workloads.split(","))
    if args.loads:
        profile.loads = tuple(float(v) for v in args.loads.split(","))
    if args.seconds:
        profile.seconds = args.seconds
    if args.sweep_load:
        profile.sweep_loads = tuple(float(v) for v in args.sweep_load.split(","))
    profile.sweep_margin = args.sweep_margin
    if args.sweep_prompts is not None:
        if args.sweep_prompts < 1:
            raise ValueError(f"--sweep-prompts must be at least 1, got {args.sweep_prompts}")
        profile.sweep_min_prompts = args.sweep_prompts
    if args.sweep_repeats < 1:
        raise ValueError(f"--sweep-repeats must be at least 1, got {args.sweep_repeats}")
    profile.sweep_repeats = args.sweep_repeats
    if args.measured_repeats < 1:
        raise ValueError(f"--measured-repeats must be at least 1, got {args.measured_repeats}")
    profile.measured_repeats = args.measured_repeats
    profile.rescale, profile.probe_prompts, profile.drift_window = not args.no_rescale, args.probe_prompts, \
        args.drift_window
    from twophase.sim.calibrate import check_drift_weight

    profile.drift_weight = check_drift_weight(args.drift_weight)  # before the runs, not at the first rescale
    profile.sim_args = shlex.split(args.sim_args)
    profile.auto.itl_ms, profile.auto.ttft_ms = args.auto_itl_ms, args.auto_ttft_ms
    profile.auto.itl_slack = args.itl_slack
    return profile


def smoke_profile(profile: Profile) -> None:
    """Tiny sizes for the tiny random model (max 256 positions): seconds per stage, the wiring only."""
    profile.max_model_len, profile.max_num_seqs, profile.budget, profile.kv_cache_memory = 256, 16, 64, "64MiB"
    profile.seconds, profile.min_prompts, profile.loads, profile.capacity_prompts = 1.0, 4, (0.6,), 16
    profile.calibrate = ["--budgets", "32,128", "--concurrency", "1,8", "--prompt-lens", "16,96", "--output-len", "16"]
    profile.sweep, profile.sweep_loads, profile.sweep_min_prompts = ["budget=32,128"], (0.6,), 4
    profile.served = ServedCalibration(burst_prompts=8, seconds=2.0, runs=(("mixed", 0.6), ("long-context", 0.6)),
                                       workloads=calibration_workloads(scale=1 / 8))  # fmt: skip
    profile.workloads = default_workloads(scale=1 / 8)
    profile.auto = AutoTest(stream_in=16, stream_out=24, long_in=160, long_out=4, rate=20.0, num_prompts=8, runs=1,
                            budgets=(32, 128))  # fmt: skip


# ---------------------------------------------------------------- processes


def run_cli(argv: list[str], log: Path, in_process: bool = True) -> None:
    """``twophase ARGV``, its output to ``log``; raises with the log's tail on failure. ``sim`` and ``bench serve``
    run in this process (no interpreter and torch start-up per point: the simulator computes nothing, the client
    only waits on sockets); ``calibrate``, which loads a model, runs in a subprocess."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        handle.write("twophase " + " ".join(argv) + "\n")
        handle.flush()
        code = cli_in_process(argv, handle) if in_process else subprocess.run(
            [sys.executable, "-m", "twophase.cli", *argv], stdout=handle, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise RuntimeError(f"twophase {argv[0]} exited with {code} (log {log}):\n{tail}")


def cli_in_process(argv: list[str], handle: IO[str]) -> int:
    """``twophase.cli.main(argv)`` with stdout, stderr and log records written to ``handle``; its exit code."""
    from twophase.cli import main as twophase_main

    records = logging.StreamHandler(handle)
    logging.getLogger().addHandler(records)
    try:
        with contextlib.redirect_stdout(handle), contextlib.redirect_stderr(handle):
            return twophase_main(argv)
    except SystemExit as exc:  # argparse
        return int(exc.code or 0)
    finally:
        logging.getLogger().removeHandler(records)


def start_server(profile: Profile, log: Path, engine: list[str], extra: list[str] | None = None) -> Proc:
    """A ``twophase serve`` on a free port, waited on and warmed up with one request unrelated to any workload."""
    argv = ["serve", "--model", profile.model, "--served-model-name", SERVED_NAME, *engine, *(extra or [])]
    server = Proc(argv, None, log).wait()
    body = {"model": SERVED_NAME, "prompt": "Warm-up: count from one to ten.", "max_tokens": 8, "temperature": 0}
    httpx.post(f"{server.url}/v1/completions", json=body, timeout=600).raise_for_status()
    return server


def bench_serve_argv(url: str, profile: Profile, workload: list[str], slos: dict[str, float], out: Path) -> list[str]:
    """``bench serve`` against ``url``: local tokenizer, EOS ignored, no ready-check request (it would put the first
    prompt in the prefix cache), detailed JSON to ``out``."""
    return ["bench", "serve", "--base-url", url, "--model", SERVED_NAME, "--tokenizer", profile.model,
            "--ready-check-timeout-sec", "0", "--ignore-eos", "--disable-tqdm", *workload, *common_result_flags(
                slos, out)]  # fmt: skip


def sim_argv(profile: Profile, steptime: Path, engine: list[str], workload: list[str], slos: dict[str, float],
             out: Path) -> list[str]:
    """``twophase sim`` with the same workload and engine flags."""
    return ["sim", "--model", profile.model, "--step-time-model", str(steptime), *engine, *workload,
            *common_result_flags(slos, out)]  # fmt: skip


def common_result_flags(slos: dict[str, float], out: Path) -> list[str]:
    """Percentiles, SLOs and where the JSON goes (bench serve and sim alike)."""
    goodput = ["--goodput", *[f"{k}:{v:g}" for k, v in slos.items()]] if slos else []
    return ["--metric-percentiles", "50,90,99", *goodput, "--save-result", "--save-detailed",
            "--result-dir", str(out.parent), "--result-filename", out.name]  # fmt: skip


def traffic_flags(num_prompts: int, rate: float, seed: int) -> list[str]:
    """The request count, the Poisson rate and the seed."""
    return ["--num-prompts", str(num_prompts), "--request-rate", str(rate), "--seed", str(seed)]


# ---------------------------------------------------------------- the step-time model's view


def load_model(path: Path) -> Any:
    """The saved step-time model."""
    from twophase.steptime.model import StepTimeModel

    return StepTimeModel.load(path)


def prefill_seconds(model: Any, prompt_len: int, budget: int, decode_rows: int = 0, decode_context: int = 0) -> float:
    """Predicted time to prefill one prompt alone (chunks of ``budget`` beside ``decode_rows`` decodes), gaps in."""
    from twophase.steptime.features import StepFeatures, chunk_attention_pairs

    total, start = 0.0, 0
    while start < prompt_len:
        n = min(max(1, budget - decode_rows), prompt_len - start)
        done = start + n >= prompt_len
        features = StepFeatures(n, 1, chunk_attention_pairs(n, start), decode_rows, decode_context,
                                decode_rows + int(done))  # fmt: skip
        total += model.predict(features) + model.gap_s
        start += n
    return total


def decode_seconds(model: Any, rows: int, context: int) -> float:
    """Predicted step + gap of ``rows`` decode rows holding ``context`` tokens in all."""
    from twophase.steptime.features import StepFeatures

    return model.predict(StepFeatures(decode_rows=rows, decode_context_tokens=context, sampled_rows=rows)) + model.gap_s


def workload_slos(model: Any, workload: Workload, budget: int) -> dict[str, float]:
    """TTFT 5x and TPOT 3x the unloaded prediction (ms, rounded)."""
    ttft = 5 * prefill_seconds(model, workload.input_len, budget)
    tpot = 3 * decode_seconds(model, 1, workload.input_len + workload.output_len // 2)
    return {"ttft": round(ttft * 1000, 1), "tpot": round(tpot * 1000, 1)}


def auto_objectives(model: Any, test: AutoTest) -> tuple[float, float]:
    """(X, Y) in ms: the ITL and TTFT objectives of the auto test (module docstring), unless given."""
    rows = 4
    chunk_step = prefill_seconds(model, test.budgets[0] - rows, test.budgets[0], rows, rows * test.stream_in)
    itl = max(0.5 * chunk_step, 3 * decode_seconds(model, 8, 8 * (test.stream_in + test.stream_out // 2)))
    ttft = 2.5 * prefill_seconds(model, test.long_in, test.budgets[1])
    return (test.itl_ms or round(itl * 1000, 1)), (test.ttft_ms or round(ttft * 1000, 1))


# ---------------------------------------------------------------- identical request lists


def request_list_mismatches(sim: list[str], bench: list[str]) -> list[str]:
    """What differs between the requests ``twophase sim ARGS`` simulates and those ``twophase bench serve ARGS``
    sends (prompt token ids as the server encodes the text, output lengths, send offsets); [] when identical."""
    from twophase.bench.cli import load_config, load_requests
    from twophase.bench.datasets import LocalCounter
    from twophase.bench.metrics import arrival_gaps, send_offsets
    from twophase.cli import build_parser
    from twophase.sim.cli import sim_workload

    parser = build_parser()
    sim_args, bench_args = parser.parse_args(sim), parser.parse_args(bench)
    simulated = sim_workload(sim_args, sim_args.request_rate)
    counter = LocalCounter(bench_args.tokenizer)
    samples = load_requests(bench_args, counter)
    config = load_config(bench_args, "http://unused", SERVED_NAME)
    rng = np.random.default_rng(config.seed)  # as bench serve's run_load paces them
    offsets = send_offsets(arrival_gaps(len(samples), config.request_rate, config.burstiness, rng), config.request_rate)
    sent = [(counter.tokenizer.encode(s.prompt), s.expected_output_len, float(o)) for s, o in zip(samples, offsets)]
    problems = [f"{len(simulated)} simulated vs {len(sent)} sent requests"] if len(simulated) != len(sent) else []
    for index, (s, (ids, out_len, offset)) in enumerate(zip(simulated, sent)):
        if s.prompt_token_ids != ids or s.max_tokens != out_len or not math.isclose(s.send_offset, offset):
            problems.append(f"request {index}: prompt {len(s.prompt_token_ids)}/{len(ids)} tokens, "
                            f"output {s.max_tokens}/{out_len}, offset {s.send_offset:.3f}/{offset:.3f}")  # fmt: skip
    return problems


def length_mismatches(measured: dict[str, Any], simulated: dict[str, Any]) -> list[str]:
    """Prompt lengths the server reported vs the simulator's, and output lengths, request by request."""
    problems = []
    for key in ("input_lens", "output_lens"):
        if measured.get(key) != simulated.get(key):
            pairs = [(i, m, s) for i, (m, s) in enumerate(zip(measured[key], simulated[key])) if m != s]
            problems.append(f"{key} differ at {len(pairs)} requests, e.g. {pairs[:3]}")
    return problems


# ---------------------------------------------------------------- comparison


def relative_error(measured: float | None, simulated: float | None) -> float:
    """(sim - measured) / measured; 0 when both are 0, inf when only the measurement is 0."""
    measured, simulated = measured or 0.0, simulated or 0.0
    if measured == 0:
        return 0.0 if simulated == 0 else math.inf
    return (simulated - measured) / measured


def figures() -> list[tuple[str, str, float]]:
    """(name, result key, tolerance) of every compared figure: TTFT/TPOT/ITL p50/p90/p99, then goodput."""
    rows = [(f"{metric.upper()} {p}", f"{p}_{metric}_ms", TOLERANCE[p]) for metric in ("ttft", "tpot", "itl")
            for p in PERCENTILES]  # fmt: skip
    return [*rows, ("goodput", "request_goodput", TOLERANCE["goodput"])]


def compare(measured: dict[str, Any], simulated: dict[str, Any],
            runs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One row per figure with the error and the verdict; with the measured ``runs`` (``measured`` their median),
    each row also gets their spread (``measured_spread``)."""
    rows = []
    for name, key, tolerance in figures():
        row = comparison_row(name, measured[key], simulated[key], tolerance)
        if runs:
            row.update(measured_spread([r.get(key) or 0.0 for r in runs], measured[key], tolerance))
        rows.append(row)
    return rows


def median_result(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The compared figures of several measured runs of one point, each the median of its runs."""
    return {key: statistics.median(r.get(key) or 0.0 for r in runs) for _, key, _ in figures()}


def measured_spread(values: list[float], median: float, tolerance: float) -> dict[str, Any]:
    """The runs' values of one figure, min, max, and the largest relative distance of a run from the median;
    ``noise_exceeds_tolerance``: some run lies outside the tolerance band around the median (a simulator equal to
    the median would fail against that run alone)."""
    spread = max(abs(relative_error(median, v)) for v in values)
    return {"measured_runs": values, "measured_min": min(values), "measured_max": max(values),
            "measured_spread": spread, "noise_exceeds_tolerance": spread > tolerance}  # fmt: skip


def comparison_row(name: str, measured: float, simulated: float, tolerance: float) -> dict[str, Any]:
    """A figure measured and simulated, its relative error and whether it is within ``tolerance``."""
    error = relative_error(measured, simulated)
    return {"figure": name, "measured": measured, "simulated": simulated, "error": error, "tolerance": tolerance,
            "pass": abs(error) <= tolerance}  # fmt: skip


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A markdown table (also readable on the terminal)."""
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


def fmt(value: Any) -> str:
    """Numbers to 2-3 significant places, booleans to pass/FAIL."""
    if isinstance(value, bool):
        return "pass" if value else "FAIL"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def pct(error: float) -> str:
    """A relative error as a signed percentage."""
    return "inf" if math.isinf(error) else f"{100 * error:+.1f}%"


# ---------------------------------------------------------------- stage 1: calibrate


def calibrate(profile: Profile, out: Path, given: str | None) -> Path:
    """The step-time model: ``given`` when set, else a served calibration or ``twophase calibrate``'s grid."""
    if given:
        return Path(given)
    if profile.calibration == "served":
        return calibrate_served(profile, out)
    path = out / "steptime.json"
    start = time.monotonic()
    print(f"calibrating ({' '.join(profile.calibrate)}) ...", flush=True)
    run_cli(["calibrate", "--model", profile.model, *profile.engine_flags(), *profile.calibrate, "-o", str(path)],
            out / "logs" / "calibrate.log", in_process=False)  # fmt: skip
    print(f"calibrated in {time.monotonic() - start:.0f} s: {path}", flush=True)
    return path


def calibrate_served(profile: Profile, out: Path) -> Path:
    """One server, driven by bench serve as the accuracy points are (a burst, then the profile's loads); its
    `/v1/records` after each run and bench serve's results feed ``twophase calibrate --from-records --served``."""
    cal = profile.served
    cal_out = out / "calibration"
    cal_out.mkdir(parents=True, exist_ok=True)
    workloads = {w.name: w for w in [*profile.workloads, *cal.workloads]}
    start = time.monotonic()
    burst_prompts = calibration_burst(profile)
    print(f"calibrating on a served run ({burst_prompts}-request burst, then {cal.runs}) ...", flush=True)
    server = start_server(profile, out / "logs" / "serve-calibration.log", profile.engine_flags())
    try:
        last_step = records_since(server.url, -1)[1]
        burst = workloads[cal.runs[0][0]]
        n = burst_prompts - burst_prompts % burst.prompt_multiple
        runs = [(f"burst-{burst.name}", [*burst.flags, *traffic_flags(n, math.inf, profile.seed + cal.seed_offset)])]
        last_step = served_run(profile, server, *runs[0], cal_out, last_step)
        provisional = fit_served(profile, cal_out, [name for name, _ in runs], cal_out / "provisional.json")
        for index, (name, load) in enumerate(cal.runs):
            workload = workloads[name]
            rate = round(load * capacity(profile, provisional, workload, cal_out, None), 4)
            n = max(profile.min_prompts, round(rate * cal.seconds))
            n = workload.prompt_multiple * math.ceil(n / workload.prompt_multiple)
            flags = [*workload.flags, *traffic_flags(n, rate, profile.seed + cal.seed_offset + 1 + index)]
            runs.append((f"{name}-{round(100 * load)}pct", flags))
            last_step = served_run(profile, server, *runs[-1], cal_out, last_step)
    finally:
        server.stop()
    path = fit_served(profile, cal_out, [name for name, _ in runs], out / "steptime.json")
    print(f"calibrated in {time.monotonic() - start:.0f} s: {path}", flush=True)
    return path


def calibration_burst(profile: Profile) -> int:
    """Requests in the calibration's burst: ``served.burst_prompts``, or the sweep's largest ``max-num-seqs`` when
    that is more, so the calibrated range holds the decode batches the sweep asks about. Fitted on at most 16
    decode rows, the linear step-time model put TPOT at 32 sequences 28-35% above the measured runs' (a decode
    row costs less as more rows share each weight panel) and halved the sweep's simulated goodput there."""
    from twophase.sim.cli import parse_sim_sweep

    seqs = [int(point["max_num_seqs"]) for point in parse_sim_sweep(profile.sweep) if "max_num_seqs" in point]
    return max([profile.served.burst_prompts, *seqs])


def served_run(profile: Profile, server: Proc, name: str, flags: list[str], out: Path, last_step: int) -> int:
    """One bench serve run of the calibration; its result and the server's new records saved; the last step id."""
    run_cli(bench_serve_argv(server.url, profile, flags, {}, out / f"{name}-result.json"),
            out.parent / "logs" / f"calibration-{name}.log")  # fmt: skip
    dump, last = records_since(server.url, last_step)
    (out / f"{name}-records.json").write_text(json.dumps(dump))
    print(f"  calibration run {name}: {len(dump['steps'])} steps", flush=True)
    return last


def records_since(url: str, since_step: int) -> tuple[dict[str, Any], int]:
    """The server's `/v1/records` steps after ``since_step`` (and its finished requests); the last step id."""
    dump = httpx.get(f"{url}/v1/records", params={"since_step": since_step}, timeout=60).json()
    steps = dump.get("steps", [])
    return dump, (steps[-1]["step_id"] if steps else since_step)


def fit_served(profile: Profile, cal_out: Path, names: list[str], path: Path) -> Path:
    """``twophase calibrate --from-records ... --served ...`` over the named runs."""
    records = [str(cal_out / f"{name}-records.json") for name in names]
    results = [str(cal_out / f"{name}-result.json") for name in names]
    run_cli(["calibrate", "--model", profile.model, "--from-records", *records, "--served", *results, "-o", str(path)],
            cal_out.parent / "logs" / f"calibrate-{path.stem}.log")  # fmt: skip
    return path


# ---------------------------------------------------------------- stage 2: accuracy


def num_prompts(profile: Profile, rate: float, multiple: int = 1, at_least: int = 0) -> int:
    """Enough prompts for ``profile.seconds`` of arrivals at ``rate`` (at least ``min_prompts`` and ``at_least``),
    rounded up to a multiple of ``multiple``."""
    n = max(profile.min_prompts, at_least, round(rate * profile.seconds))
    return multiple * math.ceil(n / multiple)


def capacity(profile: Profile, steptime: Path, workload: Workload, out: Path, server: Proc | None) -> float:
    """Request throughput with every request sent at once: simulated, or measured on ``server``."""
    n = profile.capacity_prompts if profile.capacity == "sim" or server is None else profile.capacity_prompts // 4
    n -= n % workload.prompt_multiple
    flags = [*workload.flags, *traffic_flags(n, math.inf, profile.seed + 999)]
    path = out / f"{workload.name}-capacity-{profile.capacity}.json"
    if profile.capacity == "measured" and server is not None:
        run_cli(bench_serve_argv(server.url, profile, flags, {}, path), out.parent / "logs" / f"{path.stem}.log")
    else:
        run_cli(sim_argv(profile, steptime, profile.engine_flags(), flags, {}, path),
                out.parent / "logs" / f"{path.stem}.log")  # fmt: skip
    return float(json.loads(path.read_text())["request_throughput"])


@dataclass
class AccuracyPoint:
    """One workload x load of the accuracy stage: what bench serve and sim are both given."""

    workload: Workload
    load: float
    rate: float
    seed: int
    slos: dict[str, float]
    num_prompts: int
    request_list_mismatches: list[str]

    @property
    def stem(self) -> str:
        """The point's file-name stem, e.g. ``mixed-60pct``."""
        return f"{self.workload.name}-{round(100 * self.load)}pct"

    @property
    def flags(self) -> list[str]:
        """The workload and traffic flags."""
        return [*self.workload.flags, *traffic_flags(self.num_prompts, self.rate, self.seed)]


def repeat_suffix(repeat: int) -> str:
    """File-name suffix of a measured repeat: none for the first (the names of a single-run benchmark)."""
    return "" if repeat == 0 else f"-r{repeat}"


def plan_point(profile: Profile, steptime: Path, workload: Workload, load: float, rate: float, seed: int,
               slos: dict[str, float], out: Path) -> AccuracyPoint:
    """One point, its sim and bench serve request lists checked identical before anything runs."""
    point = AccuracyPoint(workload, load, rate, seed, slos, num_prompts(profile, rate, workload.prompt_multiple), [])
    sim_call = sim_argv(profile, steptime, profile.engine_flags(), point.flags, slos, out / f"{point.stem}-sim.json")
    bench_call = bench_serve_argv("http://unused", profile, point.flags, slos, out / f"{point.stem}-measured.json")
    point.request_list_mismatches = request_list_mismatches(sim_call, bench_call)
    return point


def measure_point(profile: Profile, server: Proc, point: AccuracyPoint, repeat: int, out: Path) -> float:
    """Repeat ``repeat`` of the point's bench serve run on ``server`` (its JSON saved); its wall seconds."""
    suffix = repeat_suffix(repeat)
    path = out / f"{point.stem}-measured{suffix}.json"
    started = time.monotonic()
    run_cli(bench_serve_argv(server.url, profile, point.flags, point.slos, path),
            out.parent / "logs" / f"{point.stem}-bench{suffix}.log")  # fmt: skip
    wall = time.monotonic() - started
    if profile.measured_repeats > 1:
        print(f"  {point.stem}: measured run {repeat + 1}/{profile.measured_repeats} in {wall:.0f} s", flush=True)
    return wall


def accuracy_point(profile: Profile, steptime: Path, point: AccuracyPoint, runs: MeasuredRuns,
                   out: Path) -> dict[str, Any]:
    """Simulate the point and compare it with the median of its measured runs (and their spread). With
    ``profile.rescale`` the headline ``rows`` compare the median of one simulation per measured run, each with the
    model rescaled by the drift of earlier runs on that run's server (``drift_window``; "own": the run itself),
    and ``rows_as_calibrated`` keep the comparison with the model as fitted."""
    stem, walls = point.stem, runs.walls[point.stem]
    simulated = simulate_point(profile, steptime, point, out / f"{stem}-sim.json", [])
    measured = [json.loads((out / f"{stem}-measured{repeat_suffix(r)}.json").read_text()) for r in range(len(walls))]
    mismatches = point.request_list_mismatches + list(dict.fromkeys(
        m for run in measured for m in length_mismatches(run, simulated)))  # fmt: skip
    as_calibrated = compare(median_result(measured), simulated, measured)
    rows, scales = as_calibrated, []
    sources = runs.drift_sources.get(stem, [])
    if profile.rescale and sources and all(sources):  # every repeat has earlier runs on its server
        rescaled = [simulate_point(profile, steptime, point, out / f"{stem}-sim-rescaled{repeat_suffix(r)}.json",
                                   ["--rescale-from-records", *map(str, source), "--rescale-weight",
                                    str(profile.drift_weight)]) for r, source in enumerate(sources)]
        scales = [float(r.get("step_time_scale", 1.0)) for r in rescaled]
        rows = compare(median_result(measured), median_result(rescaled), measured)
    own = [own_drift(steptime, out / f"{stem}-records{repeat_suffix(r)}.json") for r in range(len(walls))]
    noisy = sum(r["noise_exceeds_tolerance"] for r in rows)
    drift = (f" (rescaled x{min(scales):.3f}..x{max(scales):.3f}; as calibrated "
             f"{sum(r['pass'] for r in as_calibrated)})") if scales else ""
    print(f"  {stem}: {point.num_prompts} prompts at {point.rate:.3g} req/s, {sum(walls):.0f} s measured "
          f"({len(measured)} run{'s' if len(measured) > 1 else ''}); {sum(r['pass'] for r in rows)}/{len(rows)} "
          f"figures within tolerance{drift}{f'; {noisy} with runs spread beyond it' if len(measured) > 1 else ''}"
          f"{'; REQUEST LISTS DIFFER' if mismatches else ''}", flush=True)  # fmt: skip
    return {"workload": point.workload.name, "load": point.load, "rate": point.rate, "num_prompts": point.num_prompts,
            "seed": point.seed, "slos": point.slos, "rows": rows, "rows_as_calibrated": as_calibrated,
            "drift_scales": scales, "own_drifts": own, "drift_window": profile.drift_window if scales else None,
            "drift_weight": profile.drift_weight if scales else None,
            "request_list_mismatches": mismatches, "measured_failed": max(r["failed"] for r in measured),
            "steps_out_of_range": simulated.get("steps_out_of_calibrated_range", 0),
            "wall_s": statistics.median(walls), "measured_repeats": len(measured),
            "measured_failed_runs": [r["failed"] for r in measured], "wall_s_runs": walls}  # fmt: skip


def own_drift(steptime: Path, records: Path) -> float | None:
    """A measured run's own drift: Σ actual ÷ Σ predicted step time over its recorded steps, by the model as
    calibrated (what a rescale would have had to guess from earlier runs); None without its records."""
    from twophase.sim.calibrate import drift_from_dumps

    return drift_from_dumps(load_model(steptime), [str(records)])[0] if records.exists() else None


def simulate_point(profile: Profile, steptime: Path, point: AccuracyPoint, path: Path,
                   extra: list[str]) -> dict[str, Any]:
    """``twophase sim`` of the point (``extra``: more sim flags); its result JSON."""
    run_cli([*sim_argv(profile, steptime, profile.engine_flags(), point.flags, point.slos, path), *extra,
             *profile.sim_args], out_log(path))  # fmt: skip
    return json.loads(path.read_text())


def out_log(path: Path) -> Path:
    """The log of the command writing ``path`` (under the run's logs/)."""
    return path.parent.parent / "logs" / f"{path.stem}.log"


@dataclass
class MeasuredRuns:
    """What the accuracy stage measured of one workload: each point's wall seconds per repeat, and the server
    records each repeat's prediction may be rescaled on (runs before it on the same server, ``drift_window``)."""

    walls: dict[str, list[float]] = field(default_factory=dict)
    drift_sources: dict[str, list[list[Path]]] = field(default_factory=dict)


def probe_server(profile: Profile, server: Proc, workload: Workload, seed: int, repeat: int, out: Path,
                 last_step: int) -> tuple[Path | None, int]:
    """A burst of ``profile.probe_prompts`` requests of ``workload`` (its own seed: no point's prompts or prefixes)
    before the server's first measured point, so that point runs on a warm engine; its records saved."""
    if profile.probe_prompts < 1:
        return None, last_step
    n = workload.prompt_multiple * math.ceil(profile.probe_prompts / workload.prompt_multiple)
    stem = f"{workload.name}-probe{repeat_suffix(repeat)}"
    run_cli(bench_serve_argv(server.url, profile, [*workload.flags, *traffic_flags(n, math.inf, seed + 5000)], {},
                             out / f"{stem}-result.json"), out.parent / "logs" / f"{stem}.log")  # fmt: skip
    return save_records(server, out / f"{stem}-records.json", last_step)


def save_records(server: Proc, path: Path, last_step: int) -> tuple[Path, int]:
    """The server's records since ``last_step`` written to ``path``; the path and the new last step id."""
    dump, last = records_since(server.url, last_step)
    path.write_text(json.dumps(dump))
    return path, last


def drift_sources(profile: Profile, points: list[AccuracyPoint], out: Path) -> dict[str, list[list[Path]]]:
    """Per point, per measured repeat: the records its prediction is rescaled on (``drift_window``), found by name
    in ``out``. Each repeat of a workload ran on a server of its own: the warm-up probe, then the points in load
    order. The window is all those earlier runs ("server"), the last of them ("previous"), or the run's own records
    ("own": the best any estimate from records could do, not a prediction)."""
    sources: dict[str, list[list[Path]]] = {}
    for repeat in range(profile.measured_repeats):
        for name in dict.fromkeys(p.workload.name for p in points):
            probe = out / f"{name}-probe{repeat_suffix(repeat)}-records.json"
            earlier = [probe] if profile.probe_prompts > 0 and probe.exists() else []  # the server's runs, oldest first
            for point in (p for p in points if p.workload.name == name):
                own = out / f"{point.stem}-records{repeat_suffix(repeat)}.json"
                window = {"own": [own], "previous": earlier[-1:]}.get(profile.drift_window, list(earlier))
                sources.setdefault(point.stem, []).append(window)
                earlier.append(own)
    return sources


def measure_workload(profile: Profile, steptime: Path, workload: Workload, seed: int, slos: dict[str, float],
                     out: Path, capacities: dict[str, float]) -> tuple[list[AccuracyPoint], MeasuredRuns]:
    """Every load of ``workload``, ``profile.measured_repeats`` times: each repeat runs a warm-up probe, then every
    load in turn on a fresh server (a cold prefix cache for the points' prefixes, as the first); the capacity
    comes first, on the first server. Returns the points and their runs."""
    points: list[AccuracyPoint] = []
    runs = MeasuredRuns()
    for repeat in range(profile.measured_repeats):
        log = out.parent / "logs" / f"serve-{workload.name}{repeat_suffix(repeat)}.log"
        server = start_server(profile, log, profile.engine_flags())
        try:
            if repeat == 0:
                capacities[workload.name] = capacity(profile, steptime, workload, out, server)
                print(f"{workload.name}: capacity {capacities[workload.name]:.3g} req/s ({profile.capacity}), "
                      f"SLOs {slos}", flush=True)  # fmt: skip
                points = [plan_point(profile, steptime, workload, load, round(load * capacities[workload.name], 4),
                                     seed + l_index, slos, out) for l_index, load in enumerate(profile.loads)]
            _, last_step = probe_server(profile, server, workload, seed, repeat, out, records_since(server.url, -1)[1])
            for point in points:
                runs.walls.setdefault(point.stem, []).append(measure_point(profile, server, point, repeat, out))
                _, last_step = save_records(server, out / f"{point.stem}-records{repeat_suffix(repeat)}.json",
                                            last_step)  # fmt: skip
        finally:
            server.stop()
    runs.drift_sources = drift_sources(profile, points, out)
    return points, runs


def run_accuracy(profile: Profile, steptime: Path, out: Path) -> dict[str, Any]:
    """Every workload at every load, measured ``profile.measured_repeats`` times; one server per workload and
    repeat; then every point simulated and compared."""
    model = load_model(steptime)
    out = out / "accuracy"
    out.mkdir(parents=True, exist_ok=True)
    points, capacities = [], {}
    for w_index, workload in enumerate(profile.workloads):
        if profile.accuracy_workloads and workload.name not in profile.accuracy_workloads:
            continue
        slos = workload_slos(model, workload, profile.budget)
        planned, runs = measure_workload(profile, steptime, workload, profile.seed + 100 * w_index, slos, out,
                                         capacities)  # fmt: skip
        points += [accuracy_point(profile, steptime, p, runs, out) for p in planned]
    return {"capacities": capacities, "capacity_source": profile.capacity, "rescaled": profile.rescale,
            "measured_repeats": profile.measured_repeats, "points": points}  # fmt: skip


def resimulate_accuracy(profile: Profile, steptime: Path, source: Path, out: Path) -> dict[str, Any]:
    """The accuracy stage of an earlier run (``source``: its ``--out``) simulated again with ``steptime`` and
    compared with the same measured runs; nothing is measured. The measured results and server records are copied
    into ``out``, where ``drift_sources`` finds each run's as the measuring run did."""
    saved = json.loads((source / "results.json").read_text())["accuracy"]
    out = out / "accuracy"
    out.mkdir(parents=True, exist_ok=True)
    for path in (source / "accuracy").glob("*.json"):
        if "-sim" not in path.stem:
            shutil.copy(path, out / path.name)
    workloads = {w.name: w for w in profile.workloads}
    profile.measured_repeats = int(saved["measured_repeats"])
    planned = [AccuracyPoint(workloads[p["workload"]], p["load"], p["rate"], p["seed"], p["slos"], p["num_prompts"],
                             list(p["request_list_mismatches"])) for p in saved["points"]]  # fmt: skip
    runs = MeasuredRuns({p.stem: list(s["wall_s_runs"]) for p, s in zip(planned, saved["points"])},
                        drift_sources(profile, planned, out))
    return {"capacities": saved["capacities"], "capacity_source": saved["capacity_source"],
            "rescaled": profile.rescale, "measured_repeats": profile.measured_repeats, "resimulated_from": source.name,
            "points": [accuracy_point(profile, steptime, p, runs, out) for p in planned]}  # fmt: skip


# ---------------------------------------------------------------- stage 3: sweep


def sweep_overrides(combo: dict[str, Any], profile: Profile) -> dict[str, int]:
    """Engine-flag overrides of one sweep configuration (numeric budgets and max-num-seqs)."""
    if combo.get("max_num_batched_tokens") == "auto":
        raise ValueError("the measured sweep takes numeric budgets only")
    return {"budget": int(combo.get("max_num_batched_tokens", profile.budget)),
            "max_num_seqs": int(combo.get("max_num_seqs", profile.max_num_seqs))}  # fmt: skip


def run_sweep(profile: Profile, steptime: Path, out: Path, capacities: dict[str, float]) -> dict[str, Any]:
    """Simulate the sweep, then measure every configuration; is the pick within 5% of the best measured?"""
    out = out / "sweep"
    out.mkdir(parents=True, exist_ok=True)
    workload = next(w for w in profile.workloads if w.name == profile.sweep_workload)
    slos = workload_slos(load_model(steptime), workload, profile.budget)
    if workload.name not in capacities:
        capacities[workload.name] = capacity(profile, steptime, workload, out, None)
    rates = [round(load * capacities[workload.name], 4) for load in profile.sweep_loads]
    # one request list at every rate
    prompts = num_prompts(profile, max(rates), workload.prompt_multiple, at_least=profile.sweep_min_prompts)

    def flags_at(rate: float) -> list[str]:
        return [*workload.flags, *traffic_flags(prompts, rate, profile.seed + 500)]

    sweep = [*profile.sweep, "rate=" + ",".join(map(str, rates))] if len(rates) > 1 else profile.sweep
    margin = ["--sweep-margin", str(profile.sweep_margin)] if profile.sweep_margin else []
    run_cli([*sim_argv(profile, steptime, profile.engine_flags(), flags_at(rates[0]), slos, out / "sim-sweep.json"),
             "--sweep", *sweep, *margin], out.parent / "logs" / "sim-sweep.log")  # fmt: skip
    simulated = json.loads((out / "sim-sweep.json").read_text())
    runs = [[measure_config(profile, p, flags_at(p["config"].get("request_rate", rates[0])), slos, out, repeat)
             for p in simulated["points"]] for repeat in range(profile.sweep_repeats)]  # repeats interleave configs
    points = [median_config(list(measured)) for measured in zip(*runs)]
    return {"workload": workload.name, "rates": rates, "num_prompts": prompts, "slos": slos, "sweep": sweep,
            "margin": profile.sweep_margin, "points": points, "sim_pick": simulated["best"],
            "sim_pick_same_run": simulated.get("best_same_run", []), **sweep_verdicts(points, simulated["best"]),
            **pooled_verdict(points, simulated["points"], simulated["best"])}


def sweep_verdicts(points: list[dict[str, Any]], picked: dict[str, Any] | None) -> dict[str, Any]:
    """The issue's check (``pass``: the pick's measured goodput within 5% of the best measured one's) and a stricter
    one (``pass_admissible``: the pick also reaches the attainment floor measured, and is within 5% of the best
    measured configuration that does)."""
    def attains(p: dict[str, Any]) -> bool:
        return p["measured"]["slo_attainment"]["all"] >= SWEEP_ATTAINMENT

    def goodput(p: dict[str, Any]) -> float:
        return p["measured_goodput"]

    best = max(points, key=goodput)
    admissible = max(filter(attains, points), key=goodput, default=None)
    chosen = next((p for p in points if p["config"] == picked), None)
    ratio, ratio_at_floor = goodput_ratio(chosen, best), goodput_ratio(chosen, admissible)
    pick_attains = chosen is not None and attains(chosen)
    return {"best_measured": best["config"], "best_measured_at_floor": admissible and admissible["config"],
            "pick_over_best": ratio, "pick_over_best_at_floor": ratio_at_floor, "pick_attains": pick_attains,
            "pass": ratio is not None and ratio >= 1 - SWEEP_PICK_TOLERANCE,
            "pass_admissible": pick_attains and ratio_at_floor is not None
            and ratio_at_floor >= 1 - SWEEP_PICK_TOLERANCE}  # fmt: skip


def pooled_verdict(points: list[dict[str, Any]], simulated: list[dict[str, Any]], picked: dict[str, Any] | None
                   ) -> dict[str, Any]:  # fmt: skip
    """A figure beside the issue's check, not instead of it: configurations whose simulated runs are the same in every
    figure (``same_simulated_run``) run the same steps when served, so their measured runs are replicates of one
    run. Each such class's goodput is the median of all its members' runs; ``pick_class_over_best_class`` is the
    pick's class over the best class. (Judged one by one, the best of a class of replicates is the luckiest.)"""
    from twophase.sim.cli import same_simulated_run

    def pooled(index: int) -> float:  # median of every run of the configurations simulated as points[index] was
        twins = same_simulated_run(simulated, simulated[index])
        members = [j for j, sim in enumerate(simulated) if j == index or any(sim is twin for twin in twins)]
        return statistics.median(g for j in members for g in points[j]["measured_goodput_runs"])

    classes = [pooled(i) for i in range(len(points))]
    chosen = next((i for i, p in enumerate(points) if p["config"] == picked), None)
    if chosen is None or not max(classes):
        return {"pick_class_goodput": None, "best_class_goodput": None, "pick_class_over_best_class": None}
    return {"pick_class_goodput": classes[chosen], "best_class_goodput": max(classes),
            "pick_class_over_best_class": classes[chosen] / max(classes)}


def goodput_ratio(chosen: dict[str, Any] | None, best: dict[str, Any] | None) -> float | None:
    """Measured goodput of the simulator's pick over that of ``best`` (None: no pick, no best, or no goodput)."""
    if chosen is None or best is None or not best["measured_goodput"]:
        return None
    return chosen["measured_goodput"] / best["measured_goodput"]


def median_config(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's measured runs as one: goodput and attainment are the medians of the runs (each run's
    goodput kept in ``measured_goodput_runs``); the other figures those of the median-goodput run."""
    middle = sorted(runs, key=lambda r: r["measured_goodput"])[(len(runs) - 1) // 2]
    attainment = {k: statistics.median(r["measured"]["slo_attainment"][k] for r in runs)
                  for k in middle["measured"]["slo_attainment"]}  # fmt: skip
    return {**middle, "measured_goodput": statistics.median(r["measured_goodput"] for r in runs),
            "measured": {**middle["measured"], "slo_attainment": attainment},
            "measured_goodput_runs": [r["measured_goodput"] for r in runs]}  # fmt: skip


def measure_config(profile: Profile, sim_point: dict[str, Any], flags: list[str], slos: dict[str, float],
                   out: Path, repeat: int = 0) -> dict[str, Any]:
    """One sweep configuration served and measured with the sweep's workload (``repeat``: which of its runs)."""
    overrides = sweep_overrides(sim_point["config"], profile)
    name = f"budget{overrides['budget']}-seqs{overrides['max_num_seqs']}"
    if "request_rate" in sim_point["config"]:
        name += f"-rate{sim_point['config']['request_rate']:g}"
    server = start_server(profile, out.parent / "logs" / f"serve-sweep-{name}.log", profile.engine_flags(**overrides))
    try:
        path = out / f"{name}-measured{repeat_suffix(repeat)}.json"
        run_cli(bench_serve_argv(server.url, profile, flags, slos, path),
                out.parent / "logs" / f"sweep-{name}{repeat_suffix(repeat)}.log")  # fmt: skip
    finally:
        server.stop()
    measured = json.loads(path.read_text())
    keep = ("request_goodput", "slo_attainment", "request_throughput", "p99_ttft_ms", "p99_tpot_ms")
    print(f"  sweep {name}: measured goodput {measured['request_goodput']:.3g} req/s, simulated "
          f"{sim_point['request_goodput']:.3g}", flush=True)  # fmt: skip
    return {"config": sim_point["config"], "name": name, "measured_goodput": measured["request_goodput"],
            "simulated_goodput": sim_point["request_goodput"], "measured": {k: measured[k] for k in keep},
            "simulated_attainment": sim_point["slo_attainment"]["all"],
            **({"simulated_attainment_margin": sim_point["slo_attainment_margin"]["all"]}
               if "slo_attainment_margin" in sim_point else {})}  # fmt: skip


# ---------------------------------------------------------------- stage 4: auto vs fixed


def auto_dataset(profile: Profile, path: Path) -> list[str]:
    """Write the custom JSONL (pattern of streams and long prompts, fixed seed); returns each row's kind."""
    from twophase.bench.datasets import LocalCounter, random_text

    test, counter = profile.auto, LocalCounter(profile.model)
    rng = np.random.default_rng(profile.seed + 700)
    kinds = [test.pattern[i % len(test.pattern)] for i in range(test.num_prompts)]
    lines = []
    for kind in kinds:
        length, out_len = (test.long_in, test.long_out) if kind == "L" else (test.stream_in, test.stream_out)
        text, _ = random_text(counter, length, rng)
        lines.append(json.dumps({"prompt": text, "output_tokens": out_len}))
    path.write_text("\n".join(lines) + "\n")
    return kinds


def auto_verdicts(result: dict[str, Any], itl_ms: float, ttft_ms: float, slack: float) -> list[dict[str, bool]]:
    """Per request: TTFT <= Y (bench serve's own check) and largest gap <= X (1 + slack)."""
    from twophase.bench.metrics import RequestRecord, meets_slos

    out = []
    for ttft, itl, e2el, n_out, error in zip(result["ttfts"], result["itls"], result["e2els"], result["output_lens"],
                                              result["errors"]):  # fmt: skip
        record = RequestRecord(success=not error and n_out > 0, output_len=n_out, ttft=ttft or 0.0, itl=itl or [],
                               latency=e2el or 0.0)  # fmt: skip
        ttft_ok = meets_slos(record, {"ttft": ttft_ms})
        itl_ok = record.success and max(record.itl, default=0.0) <= itl_ms * (1 + slack) / 1000
        out.append({"ttft": ttft_ok, "itl": itl_ok, "all": ttft_ok and itl_ok})
    return out


def auto_run(profile: Profile, config: str, server_flags: list[str], flags: list[str], kinds: list[str],
             objectives: tuple[float, float], out: Path) -> dict[str, Any]:
    """One served run of the auto workload; goodput and attainment by objective and by request kind."""
    itl_ms, ttft_ms = objectives
    server = start_server(profile, out.parent.parent / "logs" / f"serve-auto-{out.stem}.log", [], server_flags)
    try:
        run_cli(bench_serve_argv(server.url, profile, flags, {"ttft": ttft_ms}, out),
                out.parent.parent / "logs" / f"auto-{out.stem}.log")  # fmt: skip
    finally:
        server.stop()
    result = json.loads(out.read_text())
    verdicts = auto_verdicts(result, itl_ms, ttft_ms, profile.auto.itl_slack)

    def share(key: str, selected: str) -> float:
        chosen = [v[key] for v, kind in zip(verdicts, kinds) if kind in selected]
        return sum(chosen) / max(1, len(chosen))

    row = {"config": config, "goodput": sum(v["all"] for v in verdicts) / result["duration"],
           "attain_ttft": share("ttft", "SL"), "attain_itl": share("itl", "SL"), "attain_all": share("all", "SL"),
           "streams_itl": share("itl", "S"), "long_ttft": share("ttft", "L"), "p99_itl_ms": result["p99_itl_ms"],
           "p99_ttft_ms": result["p99_ttft_ms"], "p99_tpot_ms": result["p99_tpot_ms"],
           "failed": result["failed"]}  # fmt: skip
    print(f"  auto test {out.stem}: goodput {row['goodput']:.3g} req/s, attainment TTFT {row['attain_ttft']:.0%} "
          f"ITL {row['attain_itl']:.0%}", flush=True)  # fmt: skip
    return row


def auto_configs(profile: Profile, steptime: Path, objectives: tuple[float, float]) -> dict[str, list[str]]:
    """Server flags of fixed-small, fixed-large and auto (capped at the large budget)."""
    small, large = profile.auto.budgets
    itl_ms, ttft_ms = objectives
    slo = ["--slo-ttft-ms", f"{ttft_ms:g}"]
    auto = ["--step-budget", "auto", "--slo-itl-ms", f"{itl_ms:g}", "--step-time-model", str(steptime), *slo]
    return {f"fixed{small}": [*profile.engine_flags(budget=small), *slo],
            f"fixed{large}": [*profile.engine_flags(budget=large), *slo],
            "auto": [*profile.engine_flags(budget=large), *auto]}  # fmt: skip


def run_auto(profile: Profile, steptime: Path, out: Path) -> dict[str, Any]:
    """Interleaved runs (small, large, auto, repeat); medians per configuration; the verdicts."""
    out = out / "auto"
    out.mkdir(parents=True, exist_ok=True)
    test = profile.auto
    objectives = auto_objectives(load_model(steptime), test)
    kinds = auto_dataset(profile, out / "workload.jsonl")
    flags = ["--dataset-name", "custom", "--dataset-path", str(out / "workload.jsonl"),
             *traffic_flags(test.num_prompts, test.rate, profile.seed)]  # fmt: skip
    print(f"auto test: ITL objective {objectives[0]:g} ms (+{test.itl_slack:.0%} slack), TTFT objective "
          f"{objectives[1]:g} ms, {test.num_prompts} requests ({test.pattern}) at {test.rate:g} req/s", flush=True)
    configs = auto_configs(profile, steptime, objectives)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    for run in range(test.runs):
        for name, server_flags in configs.items():
            runs[name].append(auto_run(profile, name, server_flags, flags, kinds, objectives,
                                       out / f"{name}-run{run}.json"))  # fmt: skip
    medians = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "config"}
               for name, rows in runs.items()}  # fmt: skip
    return {"objectives_ms": {"itl": objectives[0], "ttft": objectives[1]}, "itl_slack": test.itl_slack,
            "test": dataclasses.asdict(test), "runs": runs, "medians": medians, **auto_verdict(medians, test)}


def auto_verdict(medians: dict[str, dict[str, float]], test: AutoTest) -> dict[str, Any]:
    """Auto meets both objectives (>= 90% attainment each), every fixed budget misses one, auto's goodput >= 1.1x
    the better fixed budget's."""
    fixed = [f"fixed{b}" for b in test.budgets]
    better = max(fixed, key=lambda name: medians[name]["goodput"])
    ratio = medians["auto"]["goodput"] / medians[better]["goodput"] if medians[better]["goodput"] else math.inf

    def meets(name: str) -> dict[str, bool]:
        return {k: medians[name][f"attain_{k}"] >= 0.9 for k in ("ttft", "itl")}

    return {"better_fixed": better, "auto_over_better_fixed": ratio, "meets": {n: meets(n) for n in medians},
            "pass": ratio >= 1.1 and all(meets("auto").values()) and all(not all(meets(n).values()) for n in fixed)}


# ---------------------------------------------------------------- report


def accuracy_markdown(acc: dict[str, Any]) -> list[str]:
    """Summary matrix (errors, failures starred, noisy measurements daggered), then every point's table."""
    repeats = acc.get("measured_repeats", 1)
    names = [r["figure"] for r in acc["points"][0]["rows"]] if acc["points"] else []
    matrix = [[p["workload"], f"{round(100 * p['load'])}%", p["rate"], p["num_prompts"], drift_cell(p),
               own_drift_cell(p), *[matrix_cell(r, repeats) for r in p["rows"]]] for p in acc["points"]]  # fmt: skip
    passed = sum(r["pass"] for p in acc["points"] for r in p["rows"])
    total = sum(len(p["rows"]) for p in acc["points"])
    lines = ["## Simulator vs measured", "",
             f"Capacity ({acc['capacity_source']}, req/s): " + ", ".join(
                 f"{k} {v:.3g}" for k, v in acc["capacities"].items()),
             f"Relative error (sim - measured) / measured; * = outside tolerance (p50/p90 15%, p99 25%, goodput "
             f"15%). {passed}/{total} figures within tolerance.", *drift_lines(acc), *noise_lines(acc, repeats), "",
             "Own drift: each measured run's actual / predicted step time by the model as calibrated (what the "
             "drift column estimates from earlier runs).", "",
             table(["workload", "load", "req/s", "prompts", "drift", "own drift", *names], matrix), ""]  # fmt: skip
    lines += identity_lines(acc)
    for p in acc["points"]:
        lines += [f"### {p['workload']} at {round(100 * p['load'])}% ({p['rate']} req/s, {p['num_prompts']} prompts,"
                  f" seed {p['seed']}, SLOs {p['slos']})", "", point_table(p["rows"], repeats), ""]  # fmt: skip
    return lines


def drift_cell(point: dict[str, Any]) -> str:
    """The drift scales of the point's repeats (blank: not rescaled)."""
    scales = point.get("drift_scales") or []
    return "" if not scales else " ".join(f"x{v:.2f}" for v in scales)


def own_drift_cell(point: dict[str, Any]) -> str:
    """The measured runs' own drifts (blank: records not saved)."""
    return " ".join(f"x{v:.2f}" for v in point.get("own_drifts") or [] if v is not None)


def drift_lines(acc: dict[str, Any]) -> list[str]:
    """When the headline is rescaled: how, and the count with the model as calibrated."""
    points = [p for p in acc["points"] if p.get("drift_scales")]
    if not points:
        return []
    plain = sum(r["pass"] for p in acc["points"] for r in p.get("rows_as_calibrated", p["rows"]))
    window = {"server": "all earlier runs on the same server (its warm-up probe, then the points before)",
              "previous": "the run just before it on the same server",
              "own": "the run itself (not a prediction: the best a drift estimate could do)"}[points[0]["drift_window"]]
    weight = points[0].get("drift_weight") or 1.0
    scaled = "the drift" if weight == 1.0 else f"the drift to the power {weight:g}"
    return [f"Simulated = the median of one simulation per measured run, its step times scaled by {scaled} (actual "
            f"/ predicted step time) of {window}: the drift column. With the model as calibrated: {plain} within "
            f"tolerance."]


def matrix_cell(row: dict[str, Any], repeats: int) -> str:
    """A figure's error, * when outside tolerance, † when its measured runs spread beyond the tolerance."""
    noisy = repeats > 1 and row.get("noise_exceeds_tolerance", False)
    return pct(row["error"]) + ("" if row["pass"] else " *") + (" †" if noisy else "")


def noise_lines(acc: dict[str, Any], repeats: int) -> list[str]:
    """With repeats: what "measured" is, and how many figures machine noise alone puts beyond the tolerance."""
    if repeats <= 1:
        return []
    rows = [r for p in acc["points"] for r in p["rows"]]
    noisy = [r for r in rows if r.get("noise_exceeds_tolerance")]
    failed_noisy = sum(not r["pass"] for r in noisy)
    return [f"Measured = the per-figure median of {repeats} runs (interleaved over the loads, a fresh server per "
            f"repeat). † = some run lies outside the tolerance around that median, i.e. machine noise alone exceeds "
            f"the tolerance: {len(noisy)}/{len(rows)} figures, {failed_noisy} of them outside tolerance."]


def point_table(rows: list[dict[str, Any]], repeats: int) -> str:
    """One point's figures; with repeats, the measured median, the runs' min..max and their largest deviation."""
    if repeats <= 1:
        return table(["figure", "measured", "simulated", "error", "tolerance", "verdict"],
                     [[r["figure"], r["measured"], r["simulated"], pct(r["error"]), f"{r['tolerance']:.0%}",
                       r["pass"]] for r in rows])  # fmt: skip
    return table(["figure", f"measured (median of {repeats})", "measured min..max", "run spread", "simulated",
                  "error", "tolerance", "verdict"],
                 [[r["figure"], r["measured"], f"{fmt(r['measured_min'])}..{fmt(r['measured_max'])}",
                   ("±" + pct(r["measured_spread"])[1:]) + (" †" if r["noise_exceeds_tolerance"] else ""),
                   r["simulated"], pct(r["error"]), f"{r['tolerance']:.0%}", r["pass"]] for r in rows])  # fmt: skip


def identity_lines(acc: dict[str, Any]) -> list[str]:
    """Whether sim and bench serve saw the same requests at every point."""
    bad = [p for p in acc["points"] if p["request_list_mismatches"]]
    if not bad:
        return ["Request lists: identical at every point (prompt ids, output lengths, send offsets; the server's "
                "prompt token counts equal the simulator's).", ""]
    return ["Request lists DIFFER:", *[f"- {p['workload']} {p['load']}: {p['request_list_mismatches'][:3]}"
                                       for p in bad], ""]  # fmt: skip


def measured_goodput_cell(point: dict[str, Any]) -> str:
    """A configuration's measured goodput: the median, and its runs when there were several."""
    runs = point.get("measured_goodput_runs") or []
    median = f"{point['measured_goodput']:.3g}"
    return median if len(runs) < 2 else f"{median} ({', '.join(f'{g:.3g}' for g in runs)})"


def _pooled_text(sweep: dict[str, Any]) -> list[str]:
    """The pooled figure's sentence (``pooled_verdict``), where the sweep has it."""
    if sweep.get("pick_class_over_best_class") is None:
        return []
    return ["", f"Pooled over configurations with the same simulated run (their measured runs are replicates): the "
                f"pick's class {sweep['pick_class_goodput']:.3g} req/s, the best class {sweep['best_class_goodput']:.3g}"
                f", ratio {_ratio(sweep['pick_class_over_best_class'])} (a figure beside the check above, not instead "
                f"of it)."]


def _same_run_text(same: list[dict[str, Any]] | None) -> str:
    """The configurations the simulator ran identically to its pick (their measured differences are the host's)."""
    return f" (the same simulated run as {', '.join(map(str, same))})" if same else ""


def sweep_markdown(sweep: dict[str, Any]) -> list[str]:
    """The measured and simulated goodput of every configuration and the verdict on the pick."""
    rows = [[p["name"], p["simulated_goodput"], p["simulated_attainment"], p.get("simulated_attainment_margin", "-"),
             measured_goodput_cell(p), p["measured"]["slo_attainment"]["all"]] for p in sweep["points"]]  # fmt: skip
    rates = sweep.get("rates") or [sweep.get("rate")]
    margin = sweep.get("margin", 0.0)
    return ["## Sweep pick", "", f"Workload {sweep['workload']} at {', '.join(map(str, rates))} req/s "
            f"({sweep.get('num_prompts', '?')} prompts), SLOs {sweep['slos']}, sweep {' '.join(sweep['sweep'])}, "
            f"step-time margin {100 * margin:g}%.", "",
            table(["configuration", "sim goodput", "sim attainment", "sim attainment +margin", "measured goodput",
                   "measured attainment"], rows), "",
            f"Sim picks {sweep['sim_pick']}{_same_run_text(sweep.get('sim_pick_same_run'))}; best measured at >= "
            f"{SWEEP_ATTAINMENT:.0%} attainment "
            f"{sweep.get('best_measured_at_floor')}, best measured goodput at any attainment {sweep['best_measured']}. "
            f"Picked / best measured goodput = {_ratio(sweep['pick_over_best'])} -> {_verdict(sweep['pass'])} (the "
            f"issue's check: within {SWEEP_PICK_TOLERANCE:.0%}). Stricter: the pick measured "
            f"{'at' if sweep.get('pick_attains') else 'BELOW'} the {SWEEP_ATTAINMENT:.0%} attainment floor; picked / "
            f"best measured at the floor = {_ratio(sweep.get('pick_over_best_at_floor'))} -> "
            f"{_verdict(sweep.get('pass_admissible'))} (admissible, and within {SWEEP_PICK_TOLERANCE:.0%}).",
            *_pooled_text(sweep), ""]


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _verdict(passed: bool | None) -> str:
    return "pass" if passed else "FAIL"


def auto_markdown(auto: dict[str, Any]) -> list[str]:
    """Medians per configuration and the verdict."""
    keys = ["goodput", "attain_ttft", "attain_itl", "attain_all", "streams_itl", "long_ttft", "p99_itl_ms",
            "p99_ttft_ms", "p99_tpot_ms"]  # fmt: skip
    rows = [[name, *[m[k] for k in keys]] for name, m in auto["medians"].items()]
    obj = auto["objectives_ms"]
    return ["## Auto vs fixed budgets", "",
            f"Objectives: ITL {obj['itl']:g} ms (a request's largest gap, +{auto['itl_slack']:.0%} slack), TTFT "
            f"{obj['ttft']:g} ms. Medians of {auto['test']['runs']} interleaved runs.", "",
            table(["config", *keys], rows), "",
            f"Auto / better fixed ({auto['better_fixed']}) goodput = {auto['auto_over_better_fixed']:.2f}; meets "
            f"(>= 90%): {auto['meets']} -> {'pass' if auto['pass'] else 'FAIL'}.", ""]  # fmt: skip


def write_report(results: dict[str, Any], out: Path) -> Path:
    """results.json and results.md."""
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    lines = ["# Simulator accuracy and SLO-aware budget", "", f"Model {results['model']}, engine flags "
             f"`{' '.join(results['engine_flags'])}`, step-time model {results['steptime']}.", ""]  # fmt: skip
    if "fit" in results:
        lines += [f"Step-time fit: {results['fit']}", ""]
    if "accuracy" in results:
        lines += accuracy_markdown(results["accuracy"])
    if "sweep" in results:
        lines += sweep_markdown(results["sweep"])
    if "auto" in results:
        lines += auto_markdown(results["auto"])
    path = out / "results.md"
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------- main


def make_tiny_model(out: Path) -> str:
    """The tests' tiny random Llama, written under ``out`` (smoke runs)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.tiny_models import write_tiny_llama

    return str(write_tiny_llama(out / "tiny-model"))


def default_model() -> str:
    """The engine's default model (a store name)."""
    from twophase.loader import DEFAULT_MODEL

    return DEFAULT_MODEL


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    from twophase.loader import DEFAULT_MODEL

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help=f"default {DEFAULT_MODEL} (--smoke: a tiny random model)")
    p.add_argument("--dtype", default="auto", help="engine dtype (default: auto, as `twophase serve`)")
    p.add_argument("--threads", type=int, default=None, help="engine threads (default: the engine's)")
    p.add_argument("--steptime", default=None, metavar="FILE", help="reuse a step-time model (skip calibration)")
    p.add_argument("--calibration", choices=["served", "grid"], default="served",
                   help="fit on a loaded server's records and bench serve's results (default), or on the engine "
                   "alone over a grid of step mixes")  # fmt: skip
    p.add_argument("--only", choices=["accuracy", "sweep", "auto"], default=None)
    p.add_argument("--sim-args", default="", metavar="FLAGS",
                   help='accuracy: more `twophase sim` flags for every point, e.g. "--noise"')
    p.add_argument("--resimulate", default=None, metavar="DIR",
                   help="accuracy: simulate an earlier run's points (DIR: its --out) again with --steptime and compare "
                        "with its measured runs; measures nothing")
    p.add_argument("--capacity", choices=["sim", "measured"], default="sim",
                   help="capacity from the simulator at an unbounded rate, or a measured saturated run")
    p.add_argument("--workloads", default=None, help="accuracy: a subset, e.g. decode-heavy,mixed")
    p.add_argument("--loads", default=None, help="accuracy: fractions of capacity, e.g. 0.3,0.6,0.85")
    p.add_argument("--seconds", type=float, default=None, help="accuracy: arrival window per point (default 40)")
    p.add_argument("--measured-repeats", type=int, default=1, metavar="N",
                   help="accuracy: measured runs per point, compared by their per-figure median (the issue's "
                   "accuracy claim: 3; default 1)")  # fmt: skip
    p.add_argument("--no-rescale", action="store_true",
                   help="accuracy: only the model as calibrated (default: each run predicted with the model "
                   "rescaled by the drift of earlier runs on its server, the model as calibrated alongside)")
    p.add_argument("--drift-window", choices=["server", "previous", "own"], default="server",
                   help="accuracy: rescale each run on all earlier runs of its server (default), the one before it, "
                        "or its own steps (a ceiling for any drift estimate, not a prediction)")
    p.add_argument("--drift-weight", type=float, default=0.5, metavar="W",
                   help="accuracy: rescale by drift ** W (default 0.5: halfway, see Profile.drift_weight; 1: the whole "
                   "drift)")
    p.add_argument("--probe-prompts", type=int, default=8, metavar="N",
                   help="accuracy: warm-up burst per server before its first point (0: none)")
    p.add_argument("--sweep-load", default=None,
                   help="sweep: fractions of the workload's capacity, its rate axis (default 0.4,0.55)")
    p.add_argument("--sweep-repeats", type=int, default=1, metavar="N",
                   help="sweep: measure every configuration N times (interleaved) and compare the medians")
    p.add_argument("--sweep-prompts", type=int, default=None, metavar="N",
                   help="sweep: requests in its request list, at least (default 40: one request 2.5%% of goodput)")
    p.add_argument("--sweep-margin", type=float, default=0.0, metavar="F",
                   help="sweep: the simulator's pick must keep its attainment with steps F longer (twophase sim "
                   "--sweep-margin; default 0)")  # fmt: skip
    p.add_argument("--runs", type=int, default=None, help="auto test: interleaved runs per configuration")
    p.add_argument("--auto-itl-ms", type=float, default=None, help="auto test ITL objective (default: from model)")
    p.add_argument("--auto-ttft-ms", type=float, default=None, help="auto test TTFT objective (default: from model)")
    p.add_argument("--itl-slack", type=float, default=0.25, help="auto test: allowance on a request's largest gap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="fewer, shorter points (loads 30/85%%, 1 auto run)")
    p.add_argument("--smoke", action="store_true", help="tiny random model, tiny sizes: checks the wiring")
    p.add_argument("--out", default="runs/bench-sim")
    args = p.parse_args(argv)
    if args.resimulate:
        if not args.steptime or args.only not in (None, "accuracy"):
            p.error("--resimulate takes --steptime FILE and runs the accuracy stage alone")
        args.only = "accuracy"
    return args


def stages(only: str | None) -> Iterator[str]:
    """The stages to run, in order."""
    for name in ("accuracy", "sweep", "auto"):
        if only in (None, name):
            yield name


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if args.model is None:
        args.model = make_tiny_model(out) if args.smoke else default_model()
    profile = make_profile(args)
    started = time.monotonic()
    steptime = calibrate(profile, out, args.steptime)
    model = load_model(steptime)
    results: dict[str, Any] = {"model": profile.model, "engine_flags": profile.engine_flags(),
                               "steptime": steptime.name, "profile": dataclasses.asdict(profile)}  # fmt: skip
    if model.report:
        results["fit"] = (f"hold-out mean relative error {100 * model.report.holdout_mean_rel_error:.1f}%, p90 "
                          f"{100 * model.report.holdout_p90_rel_error:.1f}%, gap {1e3 * model.gap_s:.2f} ms, "
                          f"admission {1e3 * model.admission_s:.1f} ms ({profile.calibration} calibration)")
    capacities: dict[str, float] = {}
    for stage in stages(args.only):
        stage_start = time.monotonic()
        if stage == "accuracy" and args.resimulate:
            results["accuracy"] = resimulate_accuracy(profile, steptime, Path(args.resimulate), out)
        elif stage == "accuracy":
            results["accuracy"] = run_accuracy(profile, steptime, out)
            capacities = dict(results["accuracy"]["capacities"])
        elif stage == "sweep":
            results["sweep"] = run_sweep(profile, steptime, out, capacities)
        else:
            results["auto"] = run_auto(profile, steptime, out)
        print(f"{stage}: {time.monotonic() - stage_start:.0f} s", flush=True)
        write_report(results, out)
    path = write_report(results, out)
    print(path.read_text())
    print(f"total {time.monotonic() - started:.0f} s; saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
