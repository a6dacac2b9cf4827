"""Parallel layers wrapped around an already loaded and packed rank-local model (nano-vllm / vLLM style).

The rank-local model is the ordinary ``LlamaForCausalLM`` built from ``ShardPlan.local_config``: its q/k/v and
gate/up projections are already column-parallel (they hold this rank's rows). ``parallelize`` adds the three
collectives: the all-reduce after each row-parallel projection (o_proj, down_proj), the all-reduce of the
vocab-parallel embedding, and the gather of the vocab-parallel logits to rank 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from twophase.distributed.group import TensorParallelGroup


class RowParallel(nn.Module):
    """A projection holding this rank's input columns; the partial outputs are summed over the ranks.
    (Llama's o_proj / down_proj have no bias; a bias would be added by rank 0 only.)"""

    def __init__(self, inner: nn.Module, group: TensorParallelGroup) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, local in] -> [T, out]
        """x W_localᵀ, all-reduced."""
        return self.group.all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [vocab_start, vocab_start + local rows): other ids give zeros; the sum over ranks is the
    full lookup."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.weight = weight  # [local vocab, hidden] (shared with a tied LM head)
        self.vocab_start = vocab_start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        """Full-vocabulary lookup assembled from every rank's rows."""
        local_ids = input_ids - self.vocab_start  # [T]
        outside = (local_ids < 0) | (local_ids >= self.weight.shape[0])  # [T]
        rows = F.embedding(local_ids.clamp(0, self.weight.shape[0] - 1), self.weight)  # [T, hidden]
        return self.group.all_reduce(rows.masked_fill_(outside[:, None], 0))


class GatheredLogits(nn.Module):
    """The LM head over this rank's vocabulary rows; rank 0 receives every rank's logits, in vocab order."""

    def __init__(self, inner: nn.Module, group: TensorParallelGroup) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] on rank 0
        """Full logits on rank 0 (this rank's slice elsewhere)."""
        return self.group.gather_vocab(self.inner(hidden))


def parallelize(model: nn.Module, group: TensorParallelGroup) -> None:
    """Wrap a loaded, packed rank-local LlamaForCausalLM with the collectives (in place)."""
    with torch.no_grad():
        model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight, group.plan.vocab.start, group)
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)
    model.logits_head = GatheredLogits(model.logits_head, group)
