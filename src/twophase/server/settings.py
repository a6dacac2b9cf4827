"""Server settings: limits and switches that are not engine configuration (frozen)."""

from __future__ import annotations

from dataclasses import dataclass


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
