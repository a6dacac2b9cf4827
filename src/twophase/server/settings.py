"""Server settings: limits and switches that are not engine configuration (frozen)."""

from __future__ import annotations

from dataclasses import dataclass

# How long an HTTP client of a twophase server (bench serve, the proxy) keeps an idle connection for reuse: well
# under the server's keep-alive timeout (uvicorn's 5 s). httpx's default is also 5 s, and reusing a connection the
# server was closing lost a request with a ReadError (bench serve at ~0.1 req/s on a busy 2-core CPU).
CLIENT_KEEPALIVE_EXPIRY_S = 2.0


@dataclass(frozen=True)
class ServerSettings:
    """What the HTTP layer enforces. Engine limits (context length, waiting queue) live in EngineConfig."""

    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 2 << 20
    allow_request_chat_template: bool = False
    cors_origins: tuple[str, ...] = ()
    max_n: int = 16
    max_top_logprobs: int = 20
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_prompts: int = 64
    ready_stale_s: float = 30.0  # /ready fails when the loop's heartbeat is older than this
    disconnect_poll_s: float = 0.1  # how often a non-streaming request checks that its client is still there
    records_max_steps: int = 4096
    records_max_requests: int = 1024
    slos_ms: tuple[tuple[str, float], ...] = ()  # (objective, limit ms) judged per request for the goodput metrics
