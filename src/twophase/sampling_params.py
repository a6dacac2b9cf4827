"""Per-request sampling parameters, validated on construction (before any engine state changes)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class InvalidRequestError(ValueError):
    """Bad input from a caller. ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass
class SamplingParams:
    """How to pick tokens for one request. ``temperature == 0`` means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return with each sampled token
    include_stop_str_in_output: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first invalid field."""
        _finite_range("temperature", self.temperature, 0.0, 100.0)
        _finite_range("top_p", self.top_p, 0.0, 1.0)
        if self.top_p <= 0.0:
            raise InvalidRequestError("top_p must be in (0, 1]", "top_p")
        _finite_range("min_p", self.min_p, 0.0, 1.0)
        _finite_range("repetition_penalty", self.repetition_penalty, 0.0, 100.0)
        if self.repetition_penalty <= 0.0:
            raise InvalidRequestError("repetition_penalty must be > 0", "repetition_penalty")
        _finite_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _finite_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _int_at_least("top_k", self.top_k, 0)
        _int_at_least("min_tokens", self.min_tokens, 0)
        _int_at_least("n", self.n, 1)
        if self.max_tokens is not None:
            _int_at_least("max_tokens", self.max_tokens, 1)
            if self.min_tokens > self.max_tokens:
                raise InvalidRequestError("min_tokens must be <= max_tokens", "min_tokens")
        if self.logprobs is not None:
            _int_at_least("logprobs", self.logprobs, 0)
        if self.seed is not None:
            if not isinstance(self.seed, int) or isinstance(self.seed, bool):
                raise InvalidRequestError("seed must be an integer", "seed")
            if not -(2**63) <= self.seed < 2**64:
                raise InvalidRequestError("seed must fit in 64 bits", "seed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", "stop")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative integers", "stop_token_ids")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0


def _finite_range(name: str, value: float, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number", name)
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be finite, got {value}", name)
    if not low <= value <= high:
        raise InvalidRequestError(f"{name} must be in [{low}, {high}], got {value}", name)


def _int_at_least(name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer", name)
    if value < low:
        raise InvalidRequestError(f"{name} must be >= {low}, got {value}", name)
