"""Prompt-lookup (ngram) proposals, and which requests may speculate at all."""

from __future__ import annotations

import numpy as np

from twophase.request import Request
from twophase.sampling_params import SamplingParams


def can_speculate(params: SamplingParams, num_output_tokens: int) -> bool:
    """True when acceptance can be exact for these parameters: one choice, no state that changes with each
    token inside a step (penalties, bad words, a grammar, a min_tokens mask still active)."""
    return (
        params.n == 1
        and getattr(params, "structured", None) is None
        and params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and not params.bad_words_token_ids
        and num_output_tokens >= params.min_tokens
    )


def max_proposal_len(request: Request, k: int) -> int:
    """How many tokens a request may have proposed: a step yields at most ``proposals + 1`` tokens, so never
    more than the output tokens it still may produce, minus one (which keeps every position < max_model_len)."""
    remaining = (request.max_output_tokens or 0) - request.num_output_tokens
    return max(0, min(k, remaining - 1))


class NgramProposer:
    """Proposes the tokens that followed the latest earlier occurrence of the request's last n tokens,
    trying n from ``prompt_lookup_max`` down to ``prompt_lookup_min``."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        """Up to ``k`` (default: the configured K) proposed next tokens; empty when no n-gram matches."""
        k = self.k if k is None else k
        if k <= 0:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)  # [L]
        length = tokens.shape[0]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # [L - n, n]
            hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []

    def propose_all(self, requests: list[Request]) -> dict[str, list[int]]:
        """Proposals for each of the requests (all about to decode), by request id."""
        return {r.request_id: self.propose_for(r) for r in requests}

    def propose_for(self, request: Request) -> list[int]:
        """Proposals for a running request about to decode (empty when it may not speculate)."""
        k = max_proposal_len(request, self.k)
        if k == 0 or not can_speculate(request.sampling_params, request.num_output_tokens):
            return []
        return self.propose(request.all_token_ids, k)
