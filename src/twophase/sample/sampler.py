"""Batched sampler: one call turns a batch of logits into one token (and optional logprobs) per request.

Order of operations (vLLM/HF compatible):

1. repetition penalty over prompt + output tokens (positive logits divided, negative multiplied),
2. frequency and presence penalties over output tokens (OpenAI semantics),
3. ``logit_bias`` added, and every id outside ``allowed_token_ids`` masked (one cached [vocab] row per request),
4. masks: while the output is shorter than min_tokens, EOS ids (unless ``ignore_eos``) and ``stop_token_ids``;
   the last token of each ``bad_words`` sequence whose other tokens end the output (a one-token word always),
   then each structured-output row's grammar bitmask (tokens the grammar forbids next; ``twophase.structured``),
5. ``temperature == 0`` rows take the argmax of the processed logits (no RNG is touched),
6. other rows: temperature, top-k, top-p, min-p, then one draw per row by inverse CDF (``Sampler.draw``: one
   U(0, 1) per row against the row's cumulative distribution, in float64) so a seeded row draws only from its
   own generator and its tokens do not depend on its batch neighbours or row index. One uniform per row, not
   the exponential race's ``Exponential(1)`` per vocabulary entry: on a CPU, torch's ``exponential_`` costs
   ~30 ns an element, 48 ms a step for 32 rows of a 49,152-token vocabulary (the forward of that step: ~120 ms).

``ignore_eos`` does not mask EOS (as in vLLM): the scheduler simply does not stop on it.
Logprobs are computed from the raw distribution (log_softmax of the unprocessed logits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from twophase.outputs import TokenLogprobs
from twophase.sample.top_k_top_p import apply_top_k_top_p_
from twophase.sampling_params import SamplingParams



@dataclass
class SamplingState:
    """Per-request sampling state, owned by the model runner for the life of the request.

    ``output_token_ids`` is the very list the request holds; the sampler reads it, never writes it.
    The private caches (distinct prompt ids, output counts) are built lazily and only when penalties are used.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator | None  # seeded from params.seed; None: the sampler's default generator
    _prompt_ids: set[int] | None = field(default=None, repr=False)  # distinct prompt ids (penalties only)
    _output_counts: dict[int, int] = field(default_factory=dict, repr=False)  # output id -> occurrences so far
    _num_counted: int = field(default=0, repr=False)
    _bias_row: torch.Tensor | None = field(default=None, repr=False)  # [vocab] float32
    matcher: Any = None  # twophase.structured.grammar.Matcher when the output must match a grammar

    @property
    def needs_bias(self) -> bool:
        """True when ``logit_bias`` or ``allowed_token_ids`` changes the logits."""
        return bool(self.params.logit_bias) or self.params.allowed_token_ids is not None

    def bias_row(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """logit_bias, and -inf outside allowed_token_ids (ids past the vocabulary ignored). Returns [vocab]."""
        if self._bias_row is None:
            allowed = self.params.allowed_token_ids
            row = torch.zeros(vocab_size, dtype=torch.float32) if allowed is None else \
                torch.full((vocab_size,), float("-inf"))
            if allowed is not None:
                row[[t for t in allowed if t < vocab_size]] = 0.0
            for token_id, bias in self.params.logit_bias.items():
                if token_id < vocab_size:
                    row[token_id] += bias
            self._bias_row = row.to(device)
        return self._bias_row

    def bad_word_ids(self) -> list[int]:
        """Token ids that would complete a bad word this step: a sequence's last token when the output ends with
        the rest of it (vLLM's semantics: output tokens only)."""
        output = self.output_token_ids
        banned = []
        for word in self.params.bad_words_token_ids:
            prefix_len = len(word) - 1
            if prefix_len <= len(output) and (prefix_len == 0 or output[-prefix_len:] == word[:-1]):
                banned.append(word[-1])
        return banned

    @property
    def needs_penalties(self) -> bool:
        """True when any penalty changes the logits."""
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0

    def min_tokens_mask_ids(self) -> list[int]:
        """Token ids to mask this step because ``min_tokens`` is not reached yet (empty when none)."""
        if len(self.output_token_ids) >= self.params.min_tokens:
            return []
        ids = list(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            ids.extend(self.eos_token_ids)
        return ids

    def penalty_entries(self, vocab_size: int) -> tuple[list[int], list[int]]:
        """The ids a penalty touches — every distinct id of the prompt and the output below ``vocab_size`` — and
        how often each occurs in the output (0: prompt only). Output counts are kept up to date incrementally."""
        if self._prompt_ids is None:
            self._prompt_ids = set(self.prompt_token_ids)
        output = self.output_token_ids
        if len(output) < self._num_counted:  # the output was rewound (not in normal use): count afresh
            self._output_counts, self._num_counted = {}, 0
        counts = self._output_counts
        for token_id in output[self._num_counted :]:
            counts[token_id] = counts.get(token_id, 0) + 1
        self._num_counted = len(output)
        ids = [t for t in self._prompt_ids.union(counts) if 0 <= t < vocab_size]
        return ids, [counts.get(t, 0) for t in ids]


@dataclass
class SamplerOutput:
    """One sampled token per row, and logprobs for rows whose params ask for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Samples one token per row of a ``[num_reqs, vocab]`` logits batch with per-request parameters."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._cdf_buffer: torch.Tensor | None = None  # [rows, vocab] float64, see _running_sums
        self.kernels = _built_kernels(self.device)  # top-p's selection (sample/top_k_top_p.py)

    def make_state(
        self,
        params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        eos_token_ids: tuple[int, ...] | list[int],
        matcher: Any = None,
    ) -> SamplingState:
        """Create the state for one request; a seeded, non-greedy request gets its own generator on ``device``.
        ``matcher``: the request's grammar matcher (structured outputs), advanced here by every sampled token."""
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        return SamplingState(params, prompt_token_ids, output_token_ids, tuple(eos_token_ids), generator,
                             matcher=matcher)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        """Sample one token per row. ``logits``: [num_reqs, vocab(+padding)] on ``self.device``, any float dtype.

        Columns past ``vocab_size`` (padded embeddings) are ignored. Rows pair with ``states`` by index.
        """
        if logits.shape[0] != len(states):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(states)} states")
        raw_logits = logits[:, : self.vocab_size].float()  # [num_reqs, vocab]
        logits = self.process_logits(raw_logits, states)  # [num_reqs, vocab]
        token_ids = self.first_maxima(logits)  # [num_reqs]; final for greedy rows
        sample_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if sample_rows:
            rows = torch.tensor(sample_rows, dtype=torch.long, device=logits.device)  # [num_sampled]
            sampled = self._sample(logits[rows], [states[i] for i in sample_rows])  # [num_sampled]
            token_ids[rows] = sampled
        token_id_list = token_ids.tolist()
        for state, token_id in zip(states, token_id_list):
            if state.matcher is not None:
                state.matcher.accept(token_id)
        return SamplerOutput(token_id_list, self._logprobs(raw_logits, token_ids, states))

    def first_maxima(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's first maximum (NaN as the maximum) of logits [n, vocab] float32: torch.max's indices (the greedy
        tokens, here and in ``rejection.verify_drafts``), through the C++ kernels where built. 32 x 49,152: 1.18 ms by
        torch.max (2 Zen 4 cores, torch 2.13; argmax the same), 0.1 ms by ``argmax_rows``."""
        if self.kernels is not None and logits.dtype == torch.float32 and logits.stride(-1) == 1:
            return self.kernels.argmax_rows(logits)
        return logits.max(dim=-1).indices

    def process_logits(self, raw_logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Penalties, bias, masks and grammar bitmasks of ``raw_logits`` [n, vocab]; a copy when anything changed."""
        logits = self._apply_penalties(raw_logits, states)  # [n, vocab], a copy when changed
        logits = self._apply_bias(logits, states, copy=logits is raw_logits)
        logits = self._apply_masks(logits, states, copy=logits is raw_logits)
        return self._apply_grammars(logits, states, copy=logits is raw_logits)

    def verify(
        self, logits: torch.Tensor, states: list[SamplingState], drafts: list[list[int]]
    ) -> tuple[list[list[int]], list[list[TokenLogprobs | None]]]:
        """Accept or reject proposed tokens (speculative decoding); see ``sample/rejection.py``.

        ``logits``: [sum(len(d) + 1), vocab] — for each request, the rows at its last real token and at each of its
        proposals, in order. Returns each request's new tokens (accepted proposals, then one token of the target's)
        and their logprobs."""
        from twophase.sample.rejection import verify_drafts

        return verify_drafts(self, logits, states, drafts)

    def _apply_penalties(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Repetition, frequency and presence penalties. logits: [num_reqs, vocab].

        Only the ids of a row's prompt and output change (elsewhere the penalties are the identity: x / 1,
        x - 0), so they are gathered, penalised and scattered back: a few hundred entries a row, not the vocabulary.
        """
        penalized = [i for i, s in enumerate(states) if s.needs_penalties]
        if not penalized:
            return logits
        vocab, device = logits.shape[1], logits.device
        entries = [states[i].penalty_entries(vocab) for i in penalized]  # (ids, output counts) per row
        lengths = torch.tensor([len(ids) for ids, _ in entries], device=device)  # [num_pen]

        def per_entry(values: list) -> torch.Tensor:  # a per-row value repeated for each of its entries: [E]
            return torch.repeat_interleave(torch.tensor(values, device=device), lengths)

        rows = per_entry(penalized)  # [E] entries of all penalised rows
        cols = torch.tensor([t for ids, _ in entries for t in ids], dtype=torch.long, device=device)  # [E]
        n = torch.tensor([c for _, counts in entries for c in counts], dtype=torch.float32, device=device)  # [E]
        rep, freq, pres = (per_entry([getattr(states[i].params, name) for i in penalized]).float()
                           for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"))  # [E] each
        x = logits[rows, cols]  # [E]
        x = torch.where(x > 0, x / rep, x * rep)
        x = x - freq * n - pres * (n > 0).float()
        out = logits.clone()
        out[rows, cols] = x
        return out

    def _apply_bias(self, logits: torch.Tensor, states: list[SamplingState], copy: bool) -> torch.Tensor:
        """Add each biased row's cached bias row (logit_bias, allowed_token_ids). logits: [num_reqs, vocab]."""
        biased = [i for i, s in enumerate(states) if s.needs_bias]
        if not biased:
            return logits
        if copy:
            logits = logits.clone()
        vocab, device = logits.shape[1], logits.device
        rows = torch.tensor(biased, dtype=torch.long, device=device)  # [num_biased]
        bias = torch.stack([states[i].bias_row(vocab, device) for i in biased])  # [num_biased, vocab]
        logits[rows] += bias
        return logits

    def _apply_masks(self, logits: torch.Tensor, states: list[SamplingState], copy: bool) -> torch.Tensor:
        """Mask stop/EOS ids of rows below ``min_tokens`` and ids completing a bad word. logits: [num_reqs, vocab]."""
        vocab = logits.shape[1]
        row_idx: list[int] = []
        col_idx: list[int] = []
        for i, state in enumerate(states):
            ids = [t for t in state.min_tokens_mask_ids() + state.bad_word_ids() if 0 <= t < vocab]
            row_idx.extend([i] * len(ids))
            col_idx.extend(ids)
        if not row_idx:
            return logits
        if copy:
            logits = logits.clone()
        rows = torch.tensor(row_idx, dtype=torch.long, device=logits.device)  # [num_masked]
        cols = torch.tensor(col_idx, dtype=torch.long, device=logits.device)  # [num_masked]
        logits[rows, cols] = float("-inf")
        return logits

    def _apply_grammars(self, logits: torch.Tensor, states: list[SamplingState], copy: bool) -> torch.Tensor:
        """Mask what each structured-output row's grammar forbids next. logits: [num_reqs, vocab] float32."""
        matchers = {i: s.matcher for i, s in enumerate(states) if s.matcher is not None}
        if not matchers:
            return logits
        from twophase.structured.grammar import apply_bitmasks

        if copy or not logits.is_contiguous():
            logits = logits.clone(memory_format=torch.contiguous_format)
        apply_bitmasks(logits, matchers)
        return logits

    def _sample(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then one draw per row. logits: [n, vocab] → [n] ids."""
        return self.draw(self.probabilities(logits, states), states)  # [n]

    def probabilities(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """The distribution a sampled row draws from: temperature, top-k, top-p, min-p applied to processed
        ``logits`` [n, vocab]. Returns [n, vocab], not renormalised after min-p (``draw`` needs only ratios)."""
        device, vocab = logits.device, logits.shape[1]
        params = [s.params for s in states]
        logits = logits / _column([p.temperature for p in params], device)  # [n, vocab]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            apply_top_k_top_p_(logits, top_k, top_p, self.kernels)  # logits: this call's own tensor
        probs = logits.softmax(dim=-1)  # [n, vocab]
        min_p = [p.min_p for p in params]
        if any(m > 0.0 for m in min_p):
            threshold = _column(min_p, device) * probs.amax(dim=-1, keepdim=True)  # [n, 1]
            probs = probs.masked_fill(probs < threshold, 0.0)  # ratio test: no need to renormalise
        return probs

    def draw(self, probs: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """One id per row of ``probs`` [n, vocab] (non-negative, unnormalised: each row drawn in proportion to its
        weights; a row needs some positive weight). Inverse CDF: a row's U(0, 1) times its total weight, found
        in its float64 running sum (an id of weight 0 adds nothing to the sum, so it is never chosen). A seeded
        row's uniform comes from its own generator, the others' from the sampler's, in row order. Returns [n]."""
        vocab = probs.shape[1]
        cdf = self._running_sums(probs)  # [n, vocab] float64, one sequential sum per row
        u = self._uniforms(states, probs.device)  # [n] float64
        ids = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)  # [n]
        over = ids >= vocab  # [n]: u * total rounded up to the total itself, or a total of no positive weight
        if bool(over.any()):  # the last id of positive weight; the argmax where there is none (NaN penalties)
            sub = probs[over]  # [o, vocab]
            last = torch.where(sub > 0, torch.arange(vocab, device=probs.device), -1).amax(dim=-1)  # [o]
            ids[over] = torch.where(last >= 0, last, sub.argmax(dim=-1))
        return ids

    def _running_sums(self, probs: torch.Tensor) -> torch.Tensor:
        """Each row's float64 running sum of ``probs`` [n, vocab], in a buffer kept between calls (the rows of the
        largest batch so far): a fresh [32, 49152] float64 tensor a step is 12.6 MB mapped and faulted in anew."""
        n, vocab = probs.shape
        buffer = self._cdf_buffer
        if buffer is None or buffer.shape[0] < n or buffer.shape[1] != vocab or buffer.device != probs.device:
            buffer = self._cdf_buffer = torch.empty(n, vocab, dtype=torch.float64, device=probs.device)
        cdf = buffer[:n]  # [n, vocab], contiguous
        cdf.copy_(probs)
        return cdf.cumsum_(dim=-1)

    def _uniforms(self, states: list[SamplingState], device: torch.device) -> torch.Tensor:
        """One float64 U(0, 1) per row, a seeded row's from its own generator. Returns [n]."""
        u = torch.rand(len(states), dtype=torch.float64, generator=self.generator, device=device)  # [n]
        for i, state in enumerate(states):
            if state.generator is not None:
                u[i] = torch.rand(1, dtype=torch.float64, generator=state.generator, device=device)[0]
        return u

    def _logprobs(
        self, raw_logits: torch.Tensor, token_ids: torch.Tensor, states: list[SamplingState]
    ) -> list[TokenLogprobs | None]:
        """Logprob of each sampled token and the top-n, from the raw logits [num_reqs, vocab]."""
        result: list[TokenLogprobs | None] = [None] * len(states)
        wanted = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        if not wanted:
            return result
        rows = torch.tensor(wanted, dtype=torch.long, device=raw_logits.device)  # [num_lp]
        logprobs = raw_logits[rows].log_softmax(dim=-1)  # [num_lp, vocab]
        chosen = token_ids[rows]  # [num_lp]
        chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()  # [num_lp]
        chosen_ids = chosen.tolist()
        max_n = min(max(states[i].params.logprobs or 0 for i in wanted), logprobs.shape[1])
        top_lp, top_ids = logprobs.topk(max_n, dim=-1)  # [num_lp, max_n] each
        top_lp_list, top_ids_list = top_lp.tolist(), top_ids.tolist()
        for j, i in enumerate(wanted):
            n = states[i].params.logprobs or 0
            top = list(zip(top_ids_list[j][:n], top_lp_list[j][:n]))
            result[i] = TokenLogprobs(chosen_ids[j], chosen_lp[j], top)
        return result


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    """A [n, 1] float32 column for broadcasting per-row parameters."""
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _built_kernels(device: torch.device) -> ModuleType | None:
    """The C++ kernels on the CPU when they are already built (never a build from here), else None."""
    if device.type != "cpu":
        return None
    from twophase.model.ops.extension import built_kernels

    return built_kernels()
