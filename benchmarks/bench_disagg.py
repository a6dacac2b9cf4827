"""When does prefill/decode disaggregation pay? Equal resources on a 2-core machine:

- disaggregated: a prefill server pinned to core 0 and a decode server pinned to core 1 (one thread each) behind
  ``twophase proxy``;
- colocated: one server on both cores (two threads).

Workload per run: ``--streams`` background streams (short prompts, ``--stream-tokens`` output tokens each) plus
Poisson arrivals (``--long-rate`` per second) of long prompts (``--long-min``..``--long-max`` tokens); the negative
case (``--negative``) sends short prompts only. Reported per setup, as medians over ``--runs`` interleaved runs:
the streams' TPOT p99 and ITL p99, the long prompts' TTFT (median, p99), goodput (requests meeting ``--slo-ttft``
and ``--slo-tpot``, per second), and transfer time ÷ prefill time (decode server ``timings``). Each run's
``/v1/records`` are saved under ``--out`` for ``twophase report``.

    python benchmarks/bench_disagg.py --model smollm2-135m-instruct --runs 3 --out runs/disagg
    python benchmarks/bench_disagg.py --model path/to/tiny --smoke          # a seconds-long check of the wiring
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

MODEL_NAME = "bench"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Proc:
    """A ``twophase`` subprocess on a free port, optionally pinned to CPU cores."""

    def __init__(self, args: list[str], cores: set[int] | None, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        pin = (lambda: os.sched_setaffinity(0, cores)) if cores and hasattr(os, "sched_setaffinity") else None
        self.log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "twophase.cli", *args, "--port", str(self.port),
                                      "--log-level", "warning"], stdout=self.log, stderr=subprocess.STDOUT,
                                     preexec_fn=pin)

    def wait(self, timeout: float = 600.0) -> "Proc":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args} exited with {self.proc.returncode} (log: {self.log.name})")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.proc.args} did not start (log: {self.log.name})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def start_setup(name: str, args, out: Path) -> tuple[str, list[Proc], list[Proc]]:
    """(front URL, all processes, engine servers) of one setup."""
    serve = ["serve", "--model", args.model, "--served-model-name", MODEL_NAME, "--dtype", args.dtype,
             "--max-model-len", str(args.max_model_len), *args.serve_args]
    if name == "colocated":
        server = Proc([*serve, "--threads", "2"], {0, 1}, out / "colocated.log").wait()
        return server.url, [server], [server]
    prefill = Proc([*serve, "--threads", "1", "--kv-role", "prefill"], {0}, out / "prefill.log")
    decode = Proc([*serve, "--threads", "1", "--kv-role", "decode"], {1}, out / "decode.log")
    prefill.wait(), decode.wait()
    proxy = Proc(["proxy", "--prefill", prefill.url, "--decode", decode.url], None, out / "proxy.log").wait()
    return proxy.url, [proxy, prefill, decode], [prefill, decode]


MAX_TOKEN_ID = [20000]  # prompts draw ids below this (--max-token-id)


def prompt_ids(length: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, MAX_TOKEN_ID[0]) for _ in range(length)]


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    """Stream one completion; client-side TTFT, token times and the server's final timings."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start = time.monotonic()
    times, timings, error = [], None, None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]["message"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.monotonic())
            timings = chunk.get("timings") or timings
    if resp.status_code != 200:
        error = f"HTTP {resp.status_code}"
    ttft = times[0] - start if times else None
    itl = [b - a for a, b in zip(times, times[1:])]
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    return {"prompt": len(prompt), "ttft": ttft, "itl": itl, "tpot": tpot, "timings": timings, "error": error}


async def run_workload(url: str, args, seed: int) -> list[dict]:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout)) as client:
        tasks = [asyncio.create_task(one_request(client, url, prompt_ids(args.short_len, rng), args.stream_tokens))
                 for _ in range(args.streams)]
        end = time.monotonic() + args.duration
        while time.monotonic() < end:
            await asyncio.sleep(rng.expovariate(args.long_rate))
            length = args.short_len if args.negative else rng.randint(args.long_min, args.long_max)
            tasks.append(asyncio.create_task(one_request(client, url, prompt_ids(length, rng), args.long_tokens)))
        results = await asyncio.gather(*tasks)
    for index, row in enumerate(results):
        row["kind"] = "stream" if index < args.streams else "arrival"
    return results


def pct(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def summarize(rows: list[dict], args, wall: float) -> dict:
    streams = [r for r in rows if r["kind"] == "stream" and not r["error"]]
    arrivals = [r for r in rows if r["kind"] == "arrival" and not r["error"]]
    good = [r for r in rows if not r["error"] and r["ttft"] is not None and r["ttft"] <= args.slo_ttft
            and (r["tpot"] is None or r["tpot"] <= args.slo_tpot)]
    ratios = [t["kv_transfer_ms"] / t["remote_prefill_ms"] for t in (r["timings"] or {} for r in rows)
              if t.get("kv_transfer_ms") and t.get("remote_prefill_ms")]
    return {"stream_tpot_p99": pct([r["tpot"] for r in streams], 0.99),
            "stream_itl_p99": pct([g for r in streams for g in r["itl"]], 0.99),
            "arrival_ttft_p50": pct([r["ttft"] for r in arrivals], 0.5),
            "arrival_ttft_p99": pct([r["ttft"] for r in arrivals], 0.99),
            "goodput_rps": len(good) / wall, "errors": sum(1 for r in rows if r["error"]),
            "transfer_over_prefill": statistics.median(ratios) if ratios else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=256)
    p.add_argument("--short-len", type=int, default=32)
    p.add_argument("--long-min", type=int, default=1000)
    p.add_argument("--long-max", type=int, default=1500)
    p.add_argument("--long-tokens", type=int, default=16)
    p.add_argument("--long-rate", type=float, default=0.2, help="long-prompt arrivals per second (Poisson)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run")
    p.add_argument("--negative", action="store_true", help="short prompts only (disaggregation should not pay)")
    p.add_argument("--slo-ttft", type=float, default=5.0)
    p.add_argument("--slo-tpot", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", default="runs/disagg")
    p.add_argument("--max-token-id", type=int, default=20000, help="prompt token ids are drawn below this")
    p.add_argument("--smoke", action="store_true", help="one short run with tiny sizes (checks the wiring)")
    p.add_argument("serve_args", nargs="*", help="extra `twophase serve` options (after --)")
    args = p.parse_args()
    if args.smoke:
        args.runs, args.streams, args.stream_tokens, args.duration, args.long_rate = 1, 2, 16, 2.0, 2.0
        args.long_min, args.long_max, args.long_tokens, args.max_model_len = 100, 200, 4, 1024
    MAX_TOKEN_ID[0] = args.max_token_id
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {"colocated": [], "disaggregated": []}
    for run in range(args.runs):
        for name in (("colocated", "disaggregated") if run % 2 == 0 else ("disaggregated", "colocated")):
            url, procs, servers = start_setup(name, args, out)
            try:
                start = time.monotonic()
                rows = asyncio.run(run_workload(url, args, seed=run))
                summary = summarize(rows, args, time.monotonic() - start)
                results[name].append(summary)
                for server in servers:
                    records = httpx.get(f"{server.url}/v1/records", timeout=60).json()
                    (out / f"{name}-run{run}-{server.port}.records.json").write_text(json.dumps(records))
                print(name, run, json.dumps(summary), flush=True)
            finally:
                for proc in procs:
                    proc.stop()
    medians = {name: {key: statistics.median([r[key] for r in runs if r[key] is not None] or [float("nan")])
                      for key in runs[0]} for name, runs in results.items()}
    medians = {name: {k: (None if v != v else v) for k, v in row.items()} for name, row in medians.items()}
    (out / "summary.json").write_text(json.dumps({"args": vars(args), "runs": results, "medians": medians}, indent=2))
    print(json.dumps(medians, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
