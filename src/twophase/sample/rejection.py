"""Acceptance of proposed tokens (speculative decoding), exact by construction.

For each request with proposals ``d_1..d_k`` the runner gives ``k + 1`` logits rows: row ``j`` is the target's
distribution ``p_j`` of the token after ``d_1..d_j`` (row 0 follows the last real token). Rows are processed as
ordinary sampling would process them (bias, masks, temperature, top-k/top-p/min-p); only parameters whose
processing does not change from one position to the next reach this path (``spec_decode.can_speculate``).

- greedy: keep the longest prefix of proposals equal to the row-wise argmax, then the argmax after it;
- sampled: accept ``d_j`` with probability ``min(1, p_j(d_j) / q_j(d_j))``; on the first rejection draw from the
  normalised ``max(0, p_j − q_j)`` and stop; if all are accepted draw a bonus token from ``p_k``. Proposals here
  are a point mass (``q_j(d_j) = 1``), so acceptance is ``p_j(d_j)`` and the residual is ``p_j`` without ``d_j``.
  The emitted tokens are then distributed exactly as sampling from the target token by token.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from twophase.outputs import TokenLogprobs

if TYPE_CHECKING:
    from twophase.sample.sampler import Sampler, SamplingState


def verify_drafts(
    sampler: "Sampler", logits: torch.Tensor, states: list["SamplingState"], drafts: list[list[int]]
) -> tuple[list[list[int]], list[list[TokenLogprobs | None]]]:
    """Each request's emitted tokens (accepted proposals + one target token) and their logprobs.

    ``logits``: [sum(len(d) + 1), vocab(+padding)] rows grouped per request in ``states`` order."""
    counts = [len(d) + 1 for d in drafts]
    if logits.shape[0] != sum(counts):
        raise ValueError(f"{logits.shape[0]} logits rows for {sum(counts)} positions")
    row_states = [s for s, c in zip(states, counts) for _ in range(c)]
    raw = logits[:, : sampler.vocab_size].float()  # [N, vocab]
    processed = sampler.process_logits(raw, row_states)  # [N, vocab]
    starts = [0, *itertools.accumulate(counts)]
    argmax = processed.argmax(dim=-1).tolist()  # [N]
    tokens: list[list[int]] = []
    for i, (state, draft) in enumerate(zip(states, drafts)):
        rows = processed[starts[i] : starts[i + 1]]  # [k + 1, vocab]
        if state.params.greedy:
            tokens.append(_accept_greedy(draft, argmax[starts[i] : starts[i + 1]]))
        else:
            tokens.append(_accept_sampled(sampler, rows, state, draft))
    return tokens, _logprobs(sampler, raw, row_states, starts, tokens)


def _accept_greedy(draft: list[int], targets: list[int]) -> list[int]:
    """The longest prefix of ``draft`` agreeing with ``targets`` (k + 1 argmaxes), then the next target."""
    num_accepted = 0
    while num_accepted < len(draft) and draft[num_accepted] == targets[num_accepted]:
        num_accepted += 1
    return draft[:num_accepted] + [targets[num_accepted]]


def _accept_sampled(sampler: "Sampler", rows: torch.Tensor, state: "SamplingState", draft: list[int]) -> list[int]:
    """Rejection sampling against point-mass proposals. rows: [k + 1, vocab] processed logits."""
    probs = sampler.probabilities(rows, [state] * rows.shape[0])  # [k + 1, vocab]
    probs = probs / probs.sum(dim=-1, keepdim=True)  # min-p leaves rows unnormalised
    generator = state.generator or sampler.generator
    k = len(draft)
    uniform = torch.rand(k, generator=generator, device=probs.device)  # [k]
    p_draft = probs[torch.arange(k, device=probs.device), torch.tensor(draft, dtype=torch.long, device=probs.device)]
    accepted = (uniform < p_draft).tolist()  # [k]: accept d_j with probability p_j(d_j) / 1
    num_accepted = accepted.index(False) if False in accepted else k
    target = probs[num_accepted].clone()  # [vocab]
    if num_accepted < k:
        target[draft[num_accepted]] = 0.0  # residual max(0, p - q) for a point mass q
    noise = torch.empty_like(target).exponential_(generator=generator).clamp_min_(1e-10)  # [vocab]
    return draft[:num_accepted] + [int((target / noise).argmax())]


def _logprobs(
    sampler: "Sampler", raw: torch.Tensor, row_states: list["SamplingState"], starts: list[int], tokens: list[list[int]]
) -> list[list[TokenLogprobs | None]]:
    """Logprobs (from the raw logits) of each emitted token at its own position."""
    rows = [starts[i] + j for i, emitted in enumerate(tokens) for j in range(len(emitted))]
    if not rows or all(row_states[r].params.logprobs is None for r in rows):
        return [[None] * len(emitted) for emitted in tokens]
    index = torch.tensor(rows, dtype=torch.long, device=raw.device)  # [M]
    flat_tokens = torch.tensor([t for emitted in tokens for t in emitted], dtype=torch.long, device=raw.device)  # [M]
    flat = sampler._logprobs(raw[index], flat_tokens, [row_states[r] for r in rows])
    result, offset = [], 0
    for emitted in tokens:
        result.append(flat[offset : offset + len(emitted)])
        offset += len(emitted)
    return result
