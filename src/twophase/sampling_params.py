"""Per-request sampling parameters, validated on construction (before any engine state changes)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from twophase.structured.spec import StructuredOutputSpec

MAX_LOGIT_BIAS = 100.0


class InvalidRequestError(ValueError):
    """Bad input from a caller. ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)


@dataclass
class SamplingParams:
    """How to pick tokens for one request. ``temperature == 0`` (or below 1e-5) means greedy."""

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
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # None: every token; else only these may be sampled
    bad_words: list[str] = field(default_factory=list)  # never generate these (token sequences, as vLLM)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # derived by ``resolve``
    structured: StructuredOutputSpec | None = None  # the output must match this grammar (twophase.structured)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = _token_id_keys(self.logit_bias or {})
        self.bad_words = list(self.bad_words or [])
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
        self._validate_token_controls()

    def _validate_token_controls(self) -> None:
        for bias in self.logit_bias.values():
            _finite_range("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list) or not ids or any(_not_token_id(t) for t in ids):
                raise InvalidRequestError("allowed_token_ids must be a non-empty list of token ids",
                                          "allowed_token_ids")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise InvalidRequestError("bad_words must be non-empty strings", "bad_words")
        if self.structured is not None and self.ignore_eos:
            raise InvalidRequestError("ignore_eos cannot be combined with structured outputs (a grammar ends the "
                                      "output with EOS)", "ignore_eos")

    def resolve(self, vocab_size: int, encode: Callable[[str], list[int]]) -> None:
        """Check token ids against the vocabulary and tokenize ``bad_words`` (needs the model's tokenizer).

        ``encode`` must not add special tokens. Each bad word is banned as spelled and, when that tokenizes to
        the same length with a different first token, with a leading space (vLLM's rule).
        """
        if any(t >= vocab_size for t in self.logit_bias):
            raise InvalidRequestError(f"logit_bias keys must be token ids in [0, {vocab_size})", "logit_bias")
        if any(t >= vocab_size for t in self.allowed_token_ids or []):
            raise InvalidRequestError(f"allowed_token_ids must be in [0, {vocab_size})", "allowed_token_ids")
        self.bad_words_token_ids = []
        for word in self.bad_words:
            plain = encode(word.lstrip())
            spaced = encode(" " + word.lstrip())
            self.bad_words_token_ids.append(plain)
            if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
                self.bad_words_token_ids.append(spaced)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax: temperature 0, or below ``GREEDY_TEMPERATURE`` (as vLLM's
        ``_SAMPLING_EPS``), where logits / temperature overflow to inf and the distribution to NaN."""
        return self.temperature < GREEDY_TEMPERATURE


def _finite_range(name: str, value: float, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number", name)
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be finite, got {value}", name)
    if not low <= value <= high:
        raise InvalidRequestError(f"{name} must be in [{low}, {high}], got {value}", name)


def _not_token_id(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int) or value < 0


def _token_id_keys(bias: dict) -> dict[int, float]:
    """``logit_bias`` with int keys (JSON sends them as strings, e.g. ``{"50256": -100}``)."""
    if not isinstance(bias, dict):
        raise InvalidRequestError("logit_bias must map token ids to numbers", "logit_bias")
    result = {}
    for key, value in bias.items():
        token_id = int(key) if isinstance(key, str) and key.isdecimal() else key
        if _not_token_id(token_id):
            raise InvalidRequestError(f"logit_bias key {key!r} is not a token id", "logit_bias")
        result[token_id] = value
    return result


def _int_at_least(name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer", name)
    if value < low:
        raise InvalidRequestError(f"{name} must be >= {low}, got {value}", name)
