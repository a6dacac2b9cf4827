"""Shared helpers of the peer comparison: where peers live, server processes, the S1 client, medians."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from twophase.loader.store import store_home

HOST = "127.0.0.1"  # every server compare.py starts listens on loopback only


def peers_home() -> Path:
    """``$TWOPHASE_HOME/peers``: everything the comparison installs lives here."""
    path = store_home() / "peers"
    path.mkdir(parents=True, exist_ok=True)
    return path


def median(values: list[float]) -> float:
    """Median of the finite values, NaN when there are none."""
    finite = [v for v in values if v == v]
    return statistics.median(finite) if finite else float("nan")


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def log(message: str) -> None:
    print(f"[compare] {message}", file=sys.stderr, flush=True)


class ServerError(RuntimeError):
    """A server that exited or never became healthy."""


class Server:
    """A server subprocess on 127.0.0.1:port: started by ``with``, stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, name: str, argv: list[str], port: int, health_path: str = "/health",
                 env: dict[str, str] | None = None, startup_timeout: float = 600.0) -> None:
        self.name, self.argv, self.port, self.health_path = name, argv, port, health_path
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.log_file = tempfile.NamedTemporaryFile(prefix=f"compare-{name}-", suffix=".log", delete=False)

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log_tail(self, lines: int = 15) -> str:
        text = Path(self.log_file.name).read_text(errors="replace").strip().splitlines()
        return "\n".join(text[-lines:])

    def __enter__(self) -> "Server":
        log(f"starting {self.name}: {' '.join(self.argv)}")
        self.proc = subprocess.Popen(self.argv, stdout=self.log_file, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + self.health_path, timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.__exit__(None, None, None)
        raise ServerError(f"{self.name} not healthy after {self.startup_timeout:.0f}s:\n{self.log_tail()}")

    def __exit__(self, *exc) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)  # the server's own process group (start_new_session)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


@dataclass(frozen=True)
class Workload:
    """One ``twophase bench serve`` random-dataset run."""

    num_prompts: int
    input_len: int
    output_len: int
    concurrency: int
    sampling: tuple[str, ...] = ()  # extra `bench serve` options, e.g. ("--temperature", "0.8"); () is greedy

    def describe(self) -> str:
        sampling = f", sampling {shlex.join(self.sampling)}" if self.sampling else ", greedy"
        return (f"{self.num_prompts} prompts x {self.input_len} in / {self.output_len} out, "
                f"concurrency {self.concurrency}{sampling}")


def twophase_cli() -> str:
    """The ``twophase`` console script next to this interpreter."""
    candidate = Path(sys.executable).with_name("twophase")
    return str(candidate) if candidate.exists() else "twophase"


def bench_serve(base_url: str, workload: Workload, tokenizer: str, model: str | None = None,
                seed: int = 0, label: str = "compare") -> dict:
    """Run ``twophase bench serve`` against base_url; returns its result JSON (vLLM's keys). Its initial test
    request is skipped (``--ready-check-timeout-sec 0``: the server is up and warmed up by then): it sends the
    first prompt of the run, which a server with prefix caching then answers from its cache: with it, vLLM's
    single-request pp512 timed a cache hit (1,018 tok/s; 328 without it)."""
    with tempfile.TemporaryDirectory(prefix="compare-bench-") as tmp:
        argv = [twophase_cli(), "bench", "serve", "--base-url", base_url, "--dataset-name", "random",
                "--num-prompts", str(workload.num_prompts), "--random-input-len", str(workload.input_len),
                "--random-output-len", str(workload.output_len), "--max-concurrency", str(workload.concurrency),
                "--ignore-eos", "--tokenizer", tokenizer, "--seed", str(seed), "--disable-tqdm", "--ready-check-timeout-sec", "0",
                "--save-result", "--save-detailed", "--result-dir", tmp, "--result-filename", "result.json", "--label", label,
                *workload.sampling]
        if model:
            argv += ["--model", model]
        proc = subprocess.run(argv, capture_output=True, text=True)
        result = Path(tmp) / "result.json"
        if proc.returncode != 0 or not result.exists():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-10:])
            raise RuntimeError(f"bench serve failed (rc {proc.returncode}):\n{tail}")
        return json.loads(result.read_text())


S1_KEYS = ("output_throughput", "p99_ttft_ms", "p99_tpot_ms", "failed")


def s1_summary(results: list[dict]) -> dict[str, float]:
    """Medians over repeats of S1's reported figures."""
    return {key: median([float(r.get(key, float("nan"))) for r in results]) for key in S1_KEYS}


def s1_run(base_url: str, workload: Workload, tokenizer: str, model: str | None, seed: int) -> dict:
    """One S1 run: its figures (``S1_KEYS`` and a few more) and why requests failed, if any."""
    res = bench_serve(base_url, workload, tokenizer, model, seed=seed)
    keys = (*S1_KEYS, "completed", "duration", "median_ttft_ms", "median_tpot_ms", "total_output_tokens")
    run = {key: res.get(key) for key in keys}
    run["errors"] = sorted({e for e in res.get("errors") or [] if e})[:3]
    return run


@dataclass(frozen=True)
class S1Target:
    """A server S1 is measured on: ``server()`` starts it; the client tokenizes with ``tokenizer`` and names
    ``model`` in its requests (None: the server's own name)."""

    name: str
    server: Callable[[], Server]
    tokenizer: str
    model: str | None = None


def cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot from /proc/stat's first line (busy: all but idle and iowait);
    None where there is no /proc/stat."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    total = sum(fields)  # user nice system idle iowait irq softirq steal (guest time is inside user)
    return total - fields[3] - fields[4], total


def busy_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of the CPUs' time that was busy between two ``cpu_times`` readings (0 when no time passed)."""
    busy, total = after[0] - before[0], after[1] - before[1]
    return busy / total if total > 0 else 0.0


def wait_until_quiet(max_wait_s: float = 120.0, busy_below: float = 0.1, window_s: float = 1.0) -> float:
    """Block until the CPUs are mostly idle (busy under ``busy_below`` over a ``window_s`` window) or ``max_wait_s``
    passed; returns the seconds waited. The servers just started finish their own start-up work first: twophase maps
    its KV cache while idle (~5 s for 2.9 GB on 2 cores), which otherwise fell on S1's first round (TTFT p99 7.1-7.3
    s against 4.6-4.8 in the later rounds, `compare.py --only twophase` with three columns)."""
    start = time.monotonic()
    while time.monotonic() - start < max_wait_s:
        before = cpu_times()
        if before is None:
            break
        time.sleep(window_s)
        after = cpu_times()
        if after is None or busy_share(before, after) < busy_below:
            break
    return time.monotonic() - start


def run_s1_rounds(targets: list[S1Target], workload: Workload, repeats: int) -> dict[str, dict]:
    """S1 on every target, side by side: all the servers up at once (each warmed up with a tiny run), the CPUs left
    to go quiet (``wait_until_quiet``), then ``repeats`` rounds, each running S1 once on every server with the same
    request list (seed = round), the servers' order rotated each round. A spell of host slowness then falls on one
    round of every server rather than on all runs of one, and each round's figures compare within the round.

    Returns per target name {medians of ``S1_KEYS``, "runs" (each with its "round")} or {"error": reason}."""
    results: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        live: list[tuple[S1Target, Server]] = []
        for target in targets:
            try:
                server = stack.enter_context(target.server())
                bench_serve(server.base_url, Workload(2, 16, 4, 2, workload.sampling), target.tokenizer,
                            target.model, seed=99)  # first-request costs
                live.append((target, server))
            except (ServerError, RuntimeError) as exc:
                results[target.name] = {"error": last_line(exc)}
                log(f"S1 {target.name}: {results[target.name]['error']}")
        log(f"S1: the machine quiet {wait_until_quiet():.1f} s after the last server's warm-up")
        runs: dict[str, list[dict]] = {target.name: [] for target, _ in live}
        for r in range(repeats):
            first = r % len(live) if live else 0
            for target, server in live[first:] + live[:first]:
                try:
                    run = s1_run(server.base_url, workload, target.tokenizer, target.model, seed=r)
                except RuntimeError as exc:
                    log(f"  S1 round {r + 1}/{repeats}, {target.name}: {last_line(exc)}")
                    continue
                runs[target.name].append({**run, "round": r})
                log(f"  S1 round {r + 1}/{repeats}, {target.name}: {run['output_throughput']:.1f} out tok/s, "
                    f"TTFT p99 {run['p99_ttft_ms']:.0f} ms, TPOT p99 {run['p99_tpot_ms']:.1f} ms, failed {run['failed']}")
    for name, done_runs in runs.items():
        results[name] = {**s1_summary(done_runs), "runs": done_runs} if done_runs else {"error": "every S1 run failed"}
    return results


def last_line(exc: BaseException) -> str:
    """An exception's last non-empty line, shortened: the reason to print."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[-1][:200] if lines else ''}"
