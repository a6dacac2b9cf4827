"""Draft-model proposals: a smaller model with the target's tokenizer, its own weights and its own paged KV cache.

Each step the draft catches up on the tokens it has not seen (the whole prompt at first; after a verification,
the target's new token and whatever of its own proposals were rejected are recomputed), then runs k greedy
decode steps, all requests batched. Its proposals are therefore a point mass (q(d) = 1), which the target's
rejection sampling handles exactly. The draft's counter per request is the longest common prefix of the tokens
it fed and the request's real tokens: rejected proposals roll back by that counter, as in the target.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from twophase.config import CacheConfig, ConfigError
from twophase.engine.input_batch import build_input_batch
from twophase.kv_cache.block_manager import BlockManager
from twophase.outputs import ScheduledRequest, SchedulerOutput
from twophase.request import Request
from twophase.spec_decode.ngram import can_speculate, max_proposal_len


@dataclass
class _DraftState:
    shadow: Request  # the draft's view: its block table and counter (num_computed_tokens)
    fed: list[int] = field(default_factory=list)  # tokens whose K/V the draft cache holds, by position


class DraftModelProposer:
    """Proposes k tokens per request by greedy decoding with a draft model (see the module docstring)."""

    def __init__(self, runner, num_speculative_tokens: int, target_vocab_size: int) -> None:
        """``runner``: a ModelRunner holding the draft model and its KV cache (built by the engine)."""
        if runner.model_config.vocab_size > target_vocab_size:
            raise ConfigError("the draft model's vocabulary is larger than the target's: not the same tokenizer")
        self.runner = runner
        self.k = num_speculative_tokens
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
        self.states: dict[str, _DraftState] = {}

    def propose_for(self, request: Request) -> list[int]:
        """Proposals for one request (the engine batches through ``propose_all``)."""
        return self.propose_all([request]).get(request.request_id, [])

    @torch.inference_mode()
    def propose_all(self, requests: list[Request]) -> dict[str, list[int]]:
        """Proposals for every request that may speculate, batched: one catch-up step, then k - 1 decode steps."""
        self._forget_others({r.request_id for r in requests})
        wanted = {}
        for request in requests:
            k = max_proposal_len(request, self.k)
            if k > 0 and can_speculate(request.sampling_params, request.num_output_tokens):
                wanted[request.request_id] = k
        active = [r for r in requests if r.request_id in wanted]
        feeds = {r.request_id: self._catch_up(r) for r in active}
        proposals: dict[str, list[int]] = {r.request_id: [] for r in active}
        for step in range(max(wanted.values(), default=0)):
            active = [r for r in active if feeds[r.request_id] and len(proposals[r.request_id]) < wanted[r.request_id]]
            if not active:
                break
            next_ids = self._step({r.request_id: feeds[r.request_id] for r in active})
            for request in active:
                rid = request.request_id
                token = next_ids.get(rid)
                feeds[rid] = [token] if token is not None else []
                if token is not None:
                    proposals[rid].append(token)
        return proposals

    def _catch_up(self, request: Request) -> list[int]:
        """Roll the draft's counter back to the prefix it shares with the real tokens; return the tokens to feed."""
        state = self.states.get(request.request_id)
        if state is None:
            shadow = Request(request.request_id, request.prompt_token_ids, request.sampling_params)
            state = self.states[request.request_id] = _DraftState(shadow)
        tokens = request.all_token_ids
        common = 0
        limit = min(len(state.fed), len(tokens) - 1)  # always feed at least the last real token
        while common < limit and state.fed[common] == tokens[common]:
            common += 1
        del state.fed[common:]
        state.shadow.num_computed_tokens = common
        return tokens[common:]

    def _step(self, feeds: dict[str, list[int]]) -> dict[str, int]:
        """One draft forward over every request's new tokens; the argmax after each request's last one."""
        scheduled = []
        for rid, tokens in feeds.items():
            state = self.states[rid]
            shadow = state.shadow
            if not self.block_manager.allocate_slots(shadow, len(tokens)):
                continue  # the draft cache is full: this request gets fewer proposals
            scheduled.append(ScheduledRequest(rid, list(tokens), shadow.num_computed_tokens,
                                              self.block_manager.block_ids(rid), sample=True, is_prompt=False))  # fmt: skip
            state.fed.extend(tokens)
            shadow.num_computed_tokens += len(tokens)
        if not scheduled:
            return {}
        runner = self.runner
        batch = build_input_batch(SchedulerOutput(step_id=0, scheduled=scheduled), runner.block_size, runner.device)
        hidden = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.meta,
                              batch.sample_token_indices)  # [R, hidden]
        logits = runner.model.compute_logits(hidden)  # [R, vocab]
        return dict(zip(batch.sample_request_ids, logits.argmax(dim=-1).tolist()))

    def _forget_others(self, live: set[str]) -> None:
        """Free the draft blocks of requests that finished or were preempted (they start over)."""
        for rid in [rid for rid in self.states if rid not in live]:
            self.block_manager.free(self.states.pop(rid).shadow)


def build_draft_runner(model: str, target, cache_config: CacheConfig, max_model_len: int, dtype, device, options):
    """A ModelRunner for the draft model with as many KV slots as the target's cache."""
    from twophase.engine.model_runner import ModelRunner
    from twophase.loader import open_model_source

    source = open_model_source(model)
    num_tokens = target.num_blocks * target.block_size
    cache = CacheConfig(block_size=cache_config.block_size, num_blocks=-(-num_tokens // cache_config.block_size) + 1)
    return ModelRunner(source.config, source.iter_weights(progress=False), cache, max_model_len, dtype, device,
                       options=options)  # fmt: skip
