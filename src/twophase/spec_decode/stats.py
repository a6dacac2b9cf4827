"""Acceptance counters of speculative decoding (vLLM's spec_decode metric names read these)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Counts over verified proposals: a draft is one request's proposal run in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [k]: drafts accepted at position i

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one verified draft of ``num_draft_tokens`` of which the first ``num_accepted`` were kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos.extend([0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos)))
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed tokens (None before any proposal)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens per verifying step: 1 (the target's own) + mean accepted drafts (None before any)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def copy(self) -> "SpecDecodeStats":
        """An independent snapshot."""
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.num_accepted_tokens_per_pos))  # fmt: skip
