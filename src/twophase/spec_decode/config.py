"""``--speculative-config`` (vLLM's JSON spelling) parsed into a frozen ``SpeculativeConfig``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from twophase.config import ConfigError

METHODS = ("ngram", "draft_model")
_KNOWN_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to propose tokens: ``ngram`` (prompt lookup over the request's own tokens) or ``draft_model``."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str | None = None  # draft_model: a smaller model with the target's tokenizer

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, a dict or a JSON string → a validated config (None: speculation off).

        As in vLLM, a missing ``prompt_lookup_min`` / ``_max`` takes the other's value (both missing: 5)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--speculative-config is not valid JSON: {exc.msg}") from None
        if not isinstance(value, dict):
            raise ConfigError("speculative config must be a JSON object")
        unknown = sorted(set(value) - _KNOWN_KEYS)
        if unknown:
            raise ConfigError(f"unknown speculative config keys: {', '.join(unknown)}")
        method = value.get("method", "draft_model" if value.get("model") else "ngram")
        if method not in METHODS:
            raise ConfigError(f"speculative method {method!r} is not supported; choose {' or '.join(METHODS)}")
        k = _int(value, "num_speculative_tokens", None)
        if k is None or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        low, high = _int(value, "prompt_lookup_min", None), _int(value, "prompt_lookup_max", None)
        low, high = (low or high or 5), (high or low or 5)
        if method == "ngram" and not 1 <= low <= high:
            raise ConfigError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if method == "draft_model" and not value.get("model"):
            raise ConfigError('the draft_model method needs "model"')
        return cls(method, k, low, high, value.get("model"))


def _int(value: dict[str, Any], key: str, default: int | None) -> int | None:
    v = value.get(key, default)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise ConfigError(f"speculative config {key} must be an integer")
    return v
