"""Run ``twophase serve`` as a real subprocess on a free port (for the server tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tiny_models import write_tiny_llama

MODEL_NAME = "tiny"
STARTUP_TIMEOUT_S = 120.0


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_server_model(directory: Path) -> Path:
    """A tiny random Llama with a 1024-token context (long enough for slow, abortable requests)."""
    return write_tiny_llama(directory, initializer_range=0.3, max_position_embeddings=1024)


class ServerProcess:
    """``python -m twophase.cli serve ...`` with its log in a temp file."""

    def __init__(self, model: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="twophase-serve-", suffix=".log", delete=False)
        args = [sys.executable, "-m", "twophase.cli", "serve", "--model", str(model), "--port", str(self.port),
                "--served-model-name", MODEL_NAME, "--kv-cache-memory", "32MiB", "--log-level", "warning", *extra]
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not start in {STARTUP_TIMEOUT_S}s:\n{self.logs()}")

    def logs(self) -> str:
        """Everything the server printed."""
        return Path(self.log.name).read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait, return the exit status (SIGKILL if it hangs)."""
        return stop_process(self.proc, self.log, timeout)


def stop_process(proc: subprocess.Popen, log, timeout: float = 30.0) -> int:
    """SIGTERM ``proc``, wait (SIGKILL if it hangs), close its log file; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()
    return proc.returncode


def scrape(base_url: str, headers: dict[str, str] | None = None) -> dict[tuple[str, tuple], float]:
    """/metrics parsed by prometheus_client: {(sample name, sorted labels without model_name): value}."""
    text = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[(s.name, labels)] = s.value
    return samples


def wait_idle(base_url: str, baseline_kv: float = 0.0, timeout: float = 10.0) -> dict:
    """Poll /metrics until nothing runs or waits and KV usage is back to ``baseline_kv``; returns the scrape."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(base_url)
        idle = m[("vllm:num_requests_running", ())] == 0 and m[("vllm:num_requests_waiting", ())] == 0
        if idle and abs(m[("vllm:kv_cache_usage_perc", ())] - baseline_kv) < 1e-9:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout}s: kv={m[('vllm:kv_cache_usage_perc', ())]}")
        time.sleep(0.05)
