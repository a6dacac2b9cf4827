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
    argmax = sampler.first_maxima(processed).tolist()  # [N]
    tokens: list[list[int]] = [
        _accept_greedy(draft, argmax[starts[i] : starts[i + 1]]) if state.params.greedy else []
        for i, (state, draft) in enumerate(zip(states, drafts))
    ]
    sampled = [i for i, s in enumerate(states) if not s.params.greedy]
    if sampled:
        _accept_sampled(sampler, processed, row_states, starts, [states[i] for i in sampled],
                        [drafts[i] for i in sampled], sampled, tokens)  # fmt: skip
    return tokens, _logprobs(sampler, raw, row_states, starts, tokens)


def _accept_greedy(draft: list[int], targets: list[int]) -> list[int]:
    """The longest prefix of ``draft`` agreeing with ``targets`` (k + 1 argmaxes), then the next target."""
    num_accepted = 0
    while num_accepted < len(draft) and draft[num_accepted] == targets[num_accepted]:
        num_accepted += 1
    return draft[:num_accepted] + [targets[num_accepted]]


def _accept_sampled(
    sampler: "Sampler", processed: torch.Tensor, row_states: list["SamplingState"], starts: list[int],
    states: list["SamplingState"], drafts: list[list[int]], which: list[int], tokens: list[list[int]],
) -> None:  # fmt: skip
    """Rejection sampling against point-mass proposals for the sampled requests ``which`` (all at once);
    fills ``tokens[which[j]]``. processed: [N, vocab] processed logits of every row."""
    device = processed.device
    rows = [r for i in which for r in range(starts[i], starts[i + 1])]
    index = {r: j for j, r in enumerate(rows)}
    probs = sampler.probabilities(processed[rows], [row_states[r] for r in rows])  # [M, vocab]
    probs = probs / probs.sum(dim=-1, keepdim=True)  # min-p leaves rows unnormalised
    draft_rows = [index[starts[i] + j] for i, d in zip(which, drafts) for j in range(len(d))]
    draft_ids = [t for d in drafts for t in d]
    p_draft = probs[torch.tensor(draft_rows, device=device), torch.tensor(draft_ids, device=device)]  # [D]
    accepted = (_uniform(sampler, states, drafts, device) < p_draft).tolist()  # [D]: accept with p(d) / 1
    final_rows, residual_ids, offset = [], [], 0
    for i, draft in zip(which, drafts):
        verdicts = accepted[offset : offset + len(draft)]
        offset += len(draft)
        num_accepted = verdicts.index(False) if False in verdicts else len(draft)
        tokens[i] = draft[:num_accepted]
        final_rows.append(index[starts[i] + num_accepted])
        residual_ids.append(draft[num_accepted] if num_accepted < len(draft) else -1)
    target = probs[final_rows]  # [R, vocab] (a copy)
    rejected = [j for j, t in enumerate(residual_ids) if t >= 0]
    if rejected:  # residual max(0, p - q) for a point mass q: p without the rejected proposal
        target[rejected, [residual_ids[j] for j in rejected]] = 0.0
    for i, token_id in zip(which, sampler.draw(target, states).tolist()):  # seeded rows: their own generators
        tokens[i].append(token_id)


def _uniform(sampler: "Sampler", states: list["SamplingState"], drafts: list[list[int]], device) -> torch.Tensor:
    """One U(0, 1) per proposal, a seeded request's from its own generator. Returns [D]."""
    if all(s.generator is None for s in states):
        return torch.rand(sum(len(d) for d in drafts), generator=sampler.generator, device=device)
    return torch.cat([torch.rand(len(d), generator=s.generator or sampler.generator, device=device)
                      for s, d in zip(states, drafts)])  # fmt: skip


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
