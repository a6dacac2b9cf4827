"""Owns the model, the paged KV cache tensors and the sampler; runs one step's flat batch."""

from __future__ import annotations

from typing import Iterable

import torch

from twophase.config import CacheConfig, ModelConfig
from twophase.engine.input_batch import build_input_batch
from twophase.model.registry import build_model
from twophase.outputs import ModelRunnerOutput, SchedulerOutput
from twophase.request import Request
from twophase.sample import Sampler, SamplingState


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block across all layers."""
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    """Turns SchedulerOutputs into sampled tokens. Mutates the KV cache tensors and sampling states."""

    def __init__(
        self,
        model_config: ModelConfig,
        weights: Iterable[tuple[str, torch.Tensor]],
        cache_config: CacheConfig,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        self.model_config = model_config
        self.block_size = cache_config.block_size
        self.dtype = dtype
        self.device = device
        self.model = build_model(model_config, max_model_len, dtype, device)
        self.model.load_weights(weights)
        self.model.eval()
        self.num_blocks = cache_config.num_blocks or max(
            1, cache_config.kv_cache_memory_bytes // kv_bytes_per_block(model_config, self.block_size, dtype)
        )
        self.kv_caches = self._allocate_kv_caches()
        self.sampler = Sampler(model_config.vocab_size, device=device, seed=seed)
        self.sampling_states: dict[str, SamplingState] = {}

    def _allocate_kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (self.num_blocks * self.block_size, self.model_config.num_key_value_heads, self.model_config.head_dim)
        return [
            (torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.model_config.num_hidden_layers)
        ]

    def add_request(self, request: Request) -> None:
        """Create the request's sampling state (its own generator when seeded)."""
        self.sampling_states[request.request_id] = self.sampler.make_state(
            request.sampling_params, request.prompt_token_ids, request.output_token_ids, request.eos_token_ids
        )

    def remove_request(self, request_id: str) -> None:
        """Forget a finished or aborted request's sampling state."""
        self.sampling_states.pop(request_id, None)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one model forward over the whole batch and sample for requests that reached their last token."""
        if not scheduler_output.scheduled:
            return ModelRunnerOutput()
        batch = build_input_batch(scheduler_output, self.block_size, self.device)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)  # [T, hidden]
        if not batch.sample_request_ids:
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden[batch.sample_token_indices]).float()  # [num_sampled, vocab]
        states = [self.sampling_states[rid] for rid in batch.sample_request_ids]
        sampled = self.sampler(logits, states)
        output = ModelRunnerOutput(sampled_token_ids=dict(zip(batch.sample_request_ids, sampled.token_ids)))
        for request_id, logprobs in zip(batch.sample_request_ids, sampled.logprobs):
            if logprobs is not None:
                output.logprobs[request_id] = logprobs
        return output

    @torch.inference_mode()
    def forward_logits(self, scheduler_output: SchedulerOutput) -> torch.Tensor:
        """Logits of every token of the batch ([T, vocab], float32) — for parity tests and scoring."""
        batch = build_input_batch(scheduler_output, self.block_size, self.device)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        return self.model.compute_logits(hidden).float()
