"""Start ``twophase serve`` (any --kv-role) and ``twophase proxy`` processes together on free ports."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from server_harness import MODEL_NAME, STARTUP_TIMEOUT_S, free_port, stop_process


class Process:
    """A ``python -m twophase.cli`` subprocess serving HTTP on a free port; ``wait_healthy`` separately, so
    several can start at once."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="twophase-pd-", suffix=".log", delete=False)
        command = [sys.executable, "-m", "twophase.cli", *args, "--port", str(self.port), "--log-level", "warning"]
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})

    @classmethod
    def serve(cls, model: Path, *extra: str, env: dict[str, str] | None = None) -> "Process":
        """A twophase server on the model (float32, small KV cache)."""
        return cls("serve", "--model", str(model), "--served-model-name", MODEL_NAME, "--dtype", "float32",
                   "--kv-cache-memory", "32MiB", "--threads", "1", "--linear-backend", "torch",
                   "--attention-backend", "torch", *extra, env=env)

    @classmethod
    def proxy(cls, *extra: str) -> "Process":
        """A twophase proxy (health checked every 0.2 s)."""
        return cls("proxy", "--health-interval", "0.2", *extra)

    def wait_healthy(self, timeout: float = 2 * STARTUP_TIMEOUT_S) -> "Process":
        """Block until GET /health answers 200."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"process exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"not healthy in {timeout}s:\n{self.logs()}")

    def logs(self) -> str:
        """Everything the process printed."""
        return Path(self.log.name).read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait (SIGKILL if it hangs); the exit status."""
        return stop_process(self.proc, self.log, timeout)


def kv_state(server: Process) -> dict:
    """GET /v1/kv_transfer/state of a P/D server."""
    return httpx.get(f"{server.base_url}/v1/kv_transfer/state", timeout=30).json()


def wait_clean(server: Process, timeout: float = 15.0) -> dict:
    """Poll until the server holds no lease, loads nothing, runs nothing and no block is in use; asserts its
    invariants hold. Returns the last state."""
    deadline = time.monotonic() + timeout
    while True:
        state = kv_state(server)
        assert state["invariants_ok"], state["invariants_error"]
        busy = state["num_leases"] or state["num_loading"] or state["num_requests"] or state["num_blocks_in_use"]
        if not busy:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"server not clean after {timeout}s: {state}")
        time.sleep(0.05)
