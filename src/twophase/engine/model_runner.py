"""Owns the model, the paged KV cache tensors and the sampler; runs one step's flat batch.

Everything the runner knows arrives through the ``SchedulerOutput``: requests scheduled for the first time bring
their sampling parameters (the runner keeps their sampling state and output tokens until they finish), and the
ids of requests that ended since the previous step tell it what to forget.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from dataclasses import dataclass
from collections.abc import Callable, Iterable

import torch

from twophase.config import CacheConfig, ModelConfig
from twophase.engine import hardware
from twophase.engine.input_batch import InputBatch, build_input_batch
from twophase.model.attention import cache_row_len, make_attention_backend
from twophase.model.ops.huge_pages import Prefaulter, arena
from twophase.model.ops.linear import BLOCK_QUANTIZATIONS
from twophase.model.registry import build_model
from twophase.outputs import ModelRunnerOutput, NewRequestData, SchedulerOutput
from twophase.sample import Sampler, SamplingState

log = logging.getLogger(__name__)


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block across all layers."""
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * cache_row_len(config.head_dim, dtype)
    return per_token * block_size * dtype.itemsize


def rounds_products(gemm_dtype: torch.dtype | None, quantization: str) -> bool:
    """Whether the projections give up float32's exactness already: GEMMs in bfloat16, or GGUF block formats (their
    kernels round every activation row to int8 blocks, llama.cpp's Q8 activations)."""
    return gemm_dtype == torch.bfloat16 or quantization in BLOCK_QUANTIZATIONS


def resolve_cache_dtype(name: str, model_dtype: torch.dtype, gemm_dtype: torch.dtype | None = None,
                        quantization: str = "none") -> torch.dtype:  # fmt: skip
    """The KV cache's dtype for ``--kv-cache-dtype``: auto is the model's dtype, or bfloat16 under a float32 model whose
    projections give up float32's exactness already: GEMMs in bfloat16 (``gemm_dtype``; on the AMX Xeon an S1-shaped
    offline run made 421-424 output tok/s with it against 372-375), or GGUF block formats (``quantization``: their
    kernels round every activation row to int8 blocks). bfloat16 under a float32 model stores half the bytes (K and V
    rounded to nearest even when written, read back as float32 by attention)."""
    auto = torch.bfloat16 if rounds_products(gemm_dtype, quantization) and model_dtype == torch.float32 else model_dtype
    dtypes = {"auto": auto, "float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
    if name not in dtypes:
        raise ValueError(f"unknown KV cache dtype {name!r}; choose auto, float32, bfloat16 or int8")
    dtype = dtypes[name]
    if dtype == torch.int8:  # any model dtype: K and V quantized a row at a time (attention.quantize_int8_rows)
        return dtype
    if dtype != model_dtype and not (dtype == torch.bfloat16 and model_dtype == torch.float32):
        raise ValueError(f"--kv-cache-dtype {name} needs a float32 model or the model's own dtype "
                         f"({str(model_dtype).removeprefix('torch.')})")  # fmt: skip
    return dtype


@dataclass
class RunnerOptions:
    """How the runner executes: weight format and attention backend (see EngineConfig)."""

    quantization: str = "none"
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    max_num_seqs: int = 64
    deterministic: bool = False  # batch-invariant: every row through the kernels (see model/ops/linear.py)
    gemm_dtype: torch.dtype | None = None  # bfloat16: multi-row projections through torch's GEMM on a bf16 copy
    # (resolved by llm_engine.resolve_gemm_dtype: never with --deterministic)


@dataclass
class _RequestState:
    sampling_state: SamplingState
    output_token_ids: list[int]  # the runner's own copy, appended as it samples


class ModelRunner:
    """Turns SchedulerOutputs into sampled tokens. Mutates the KV cache tensors and its per-request states."""

    def __init__(
        self,
        model_config: ModelConfig,
        weights: Iterable[tuple[str, torch.Tensor]] | Callable[..., Iterable[tuple[str, torch.Tensor]]],
        cache_config: CacheConfig,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
        seed: int = 0,
        options: RunnerOptions | None = None,
        native_weights: dict | None = None,
        tp=None,
    ) -> None:
        """``weights``: the HF-named tensors, or their reader ``weights(skip=names)`` (``ModelSource.iter_weights``),
        which lets the runner leave out the weights it builds from stored blocks alone (never dequantised).
        ``native_weights``: HF name → (format, tensors) of weights as stored in a GGUF file, executed as stored
        when the quantization asks for their format (or is ``gguf``), or widened exactly. ``tp``: this rank's
        ``distributed.TensorParallelGroup`` — the runner then holds only its shard (weights, KV heads)."""
        options = options or RunnerOptions()
        self.model_config = model_config
        self.tp = tp
        self.local_config = model_config  # the shapes this process holds (a shard of them under tensor parallelism)
        if tp is not None:
            from twophase.distributed.sharding import shard_native

            self.local_config = tp.plan.local_config(model_config)
            native_weights = shard_native(native_weights, tp.plan, model_config)
        self.block_size = cache_config.block_size
        self.dtype = dtype
        self.device = device
        kernels = self._linear_kernels(options)
        self.gemm_dtype = options.gemm_dtype if kernels is not None else None  # the kernels' op takes the GEMM
        self.quantization = options.quantization
        self.cache_dtype = resolve_cache_dtype(cache_config.cache_dtype, dtype, self.gemm_dtype, options.quantization)
        self.backend = make_attention_backend(
            options.attention_backend, self.local_config.num_attention_heads, self.local_config.num_key_value_heads,
            model_config.head_dim, device, dtype, prefill_products=self._prefill_products(kernels),
        )  # fmt: skip
        self.model = build_model(self.local_config, max_model_len, dtype, device, self.backend)
        skipped = set()
        if callable(weights) and native_weights and tp is None:  # a reader can leave out what blocks alone build
            skipped = self.model.weights_built_from_blocks(native_weights, options.quantization, kernels, dtype, device)
        self.model.load_weights(self._weight_stream(weights, skipped), absent=skipped)
        self.model.eval()
        self._pack(options, native_weights, kernels)
        self.num_blocks = self._num_blocks(cache_config, max_model_len, options.max_num_seqs)
        if tp is not None:
            from twophase.distributed.layers import parallelize

            parallelize(self.model, tp)
            self.num_blocks = tp.agree(self.num_blocks)  # rank 0's count: the same block ids on every rank
        self.kv_caches = self._allocate_kv_caches()
        self.kv_prefaulter = Prefaulter([t for pair in self.kv_caches for t in pair])  # CPU caches only
        self.sampler = Sampler(model_config.vocab_size, device=device, seed=seed)
        self.requests: dict[str, _RequestState] = {}

    def _weight_stream(self, weights, skip: set[str]) -> Iterable[tuple[str, torch.Tensor]]:
        """The tensors to load: read without ``skip`` when ``weights`` is a reader; this rank's shard of each under
        tensor parallelism."""
        weights = weights(skip=skip) if callable(weights) else weights
        if self.tp is None:
            return weights
        from twophase.distributed.sharding import shard_weights

        return shard_weights(weights, self.tp.plan, self.model_config)

    def _prefill_products(self, kernels) -> str:
        """How the kernel attention multiplies prefill chunks (``attention.make_attention_backend``): in bfloat16 only
        where the GEMMs and the cache are bfloat16 already; there, through torch's SDPA on a CPU with AMX, else on the
        kernel's AVX512-BF16 dot products where it has them. Without AMX torch's CPU flash attention multiplies
        bfloat16 at its float32 rate: one 512-token prompt a layer, 2 Zen 4 cores, 4.5-4.7 ms in the kernel's
        float32 products against 5.9-6.5 through SDPA; 8 x 256 tokens 9.1-11.6 against 12.2-15.2 (on 2 AMX Xeon
        cores SDPA took 1.8-2.5x less than the kernel from 64 queries on). The dot products took 1.9 / 4.5 ms there
        (``attention.DOT_MIN_QUERIES``); summed on float32 FMAs (``dot-fma``) where ``bf16_gemm``'s are
        (``gemm.dot_sums_on_fma``)."""
        if not (rounds_products(self.gemm_dtype, self.quantization) and self.cache_dtype in (torch.bfloat16, torch.int8)):
            return "float32"
        if hardware.cpu_has_amx():
            return "sdpa"
        if kernels is None or not kernels.bf16_gemm_available():
            return "float32"
        from twophase.model.ops.gemm import dot_sums_on_fma

        return "dot-fma" if dot_sums_on_fma() else "dot"

    def _linear_kernels(self, options: RunnerOptions):
        """The C++ kernels module the linear layers run on (CPU, ``--linear-backend auto``, built), else None."""
        if options.linear_backend not in ("auto", "torch"):
            raise ValueError(f"unknown linear backend {options.linear_backend!r}; choose auto or torch")
        if self.device.type != "cpu" or options.linear_backend != "auto":
            return None
        from twophase.model.ops.extension import load_kernels

        return load_kernels()

    def _pack(self, options: RunnerOptions, native_weights: dict | None, kernels) -> None:
        quantization = options.quantization
        if options.deterministic:
            self._check_batch_invariant(kernels)
        self.linear_kernels = kernels is not None
        self.model.pack(quantization, kernels, native_weights, batch_invariant=options.deterministic)
        if self.gemm_dtype is not None:
            from twophase.model.ops.gemm import use_gemm_weights

            use_gemm_weights(self.model, self.gemm_dtype, dot_products=not hardware.cpu_has_amx())

    def _check_batch_invariant(self, kernels) -> None:
        """``deterministic`` runs every op through a kernel whose rows do not see each other; refuse otherwise."""
        missing = []
        if kernels is None:
            missing.append("the C++ kernels (CPU, --linear-backend auto, built)")
        if self.backend.name != "kernel":
            missing.append("the kernel attention backend")
        if self.dtype not in (torch.float32, torch.bfloat16):
            missing.append(f"float32 or bfloat16 (not {self.dtype})")
        if missing:
            raise ValueError("--deterministic needs " + ", ".join(missing))

    def _num_blocks(self, cache_config: CacheConfig, max_model_len: int, max_num_seqs: int) -> int:
        per_block = kv_bytes_per_block(self.local_config, self.block_size, self.cache_dtype)
        if cache_config.num_blocks:
            return cache_config.num_blocks
        budget = cache_config.kv_cache_memory_bytes
        if budget is None:
            wanted = -(-max_model_len // self.block_size) * max_num_seqs * per_block  # every sequence at full length
            budget = min(wanted, hardware.kv_cache_budget(self.device))
        return max(1, budget // per_block)

    def _allocate_kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (self.num_blocks * self.block_size, self.local_config.num_key_value_heads,
                 cache_row_len(self.local_config.head_dim, self.cache_dtype))  # int8: each row's scale after it
        # never zeroed (no start-up time, pages touched only when used): no backend reads a slot before it is written.
        # On a CPU in huge-page memory: decode attention reads blocks of slots at scattered addresses.
        def empty() -> torch.Tensor:
            if self.device.type == "cpu":
                return arena().empty(shape, self.cache_dtype)
            return torch.empty(shape, dtype=self.cache_dtype, device=self.device)

        return [(empty(), empty()) for _ in range(self.model_config.num_hidden_layers)]

    def prefault_kv_cache(self) -> bool:
        """Map one more slice of the KV cache's pages ahead of their first write (CPU; see ``Prefaulter``); False
        when nothing is left to map."""
        return self.kv_prefaulter.step()

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes held by the KV cache tensors."""
        return self.num_blocks * kv_bytes_per_block(self.local_config, self.block_size, self.cache_dtype)

    def _runs_int8_gemms(self) -> bool:
        """Whether block-format layers run many rows on the int8 GEMM (``QuantizedLinear.use_int8_gemm``)."""
        return any(getattr(m, "int8_gemm", None) is not None for m in self.model.modules())

    def describe(self) -> str:
        """One line for start-up logs: weight format, kernels, attention backend, KV cache size."""
        tokens = self.num_blocks * self.block_size
        weights = self.quantization if self.quantization != "none" else str(self.dtype).removeprefix("torch.")
        return (
            f"weights {weights} ({'C++ kernels' if self.linear_kernels else 'plain torch'}"
            + (f"; {str(self.gemm_dtype).removeprefix('torch.')} GEMMs for many rows" if self.gemm_dtype else "")
            + ("; int8 GEMMs for many rows" if self._runs_int8_gemms() else "")
            + "), attention "
            f"{self.backend.name}, KV cache {self.num_blocks} blocks x {self.block_size} = {tokens} tokens "
            f"({self.kv_cache_bytes / 2**20:.0f} MiB, {str(self.cache_dtype).removeprefix('torch.')}), "
            f"{torch.get_num_threads()} threads"
            + (f", tensor parallel {self.tp.size} (this rank: 1/{self.tp.size} of heads, MLP, vocab)" if self.tp else "")
        )

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in scheduler_output.new_requests:
            self.requests[new.request_id] = self._new_state(new)

    def _new_state(self, new: NewRequestData) -> _RequestState:
        output_token_ids: list[int] = []
        matcher = None
        if new.grammar is not None:
            from twophase.structured.grammar import Matcher

            matcher = Matcher(new.grammar)
        state = self.sampler.make_state(new.sampling_params, new.prompt_token_ids, output_token_ids,
                                        new.eos_token_ids, matcher)
        return _RequestState(state, output_token_ids)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one model forward over the whole batch and sample for requests that reached their last token."""
        self._update_states(scheduler_output)
        if not scheduler_output.scheduled:
            return ModelRunnerOutput()
        batch = build_input_batch(scheduler_output, self.block_size, self.device)
        logits = self.sampled_logits(scheduler_output, batch)
        if logits is None:
            return ModelRunnerOutput()
        logits = logits.float()  # [num_logits, vocab]
        if all(c == 1 for c in batch.sample_counts):
            return self._sample(logits, batch.sample_request_ids)
        return self._sample_and_verify(logits, batch.sample_request_ids, batch.sample_counts, scheduler_output)

    @torch.inference_mode()
    def sampled_logits(self, scheduler_output: SchedulerOutput, batch: InputBatch) -> torch.Tensor | None:
        """One forward of ``batch`` (built from ``scheduler_output``) and the logits of its sampled rows
        ([num_logits, vocab], model dtype; None when no row samples). Under tensor parallelism the other ranks
        run the same forward. Neither samples nor touches request states (the phase benchmark times this)."""
        with self._distributed("execute", scheduler_output):
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta,
                                batch.sample_token_indices)  # [num_logits, hidden]
            if not batch.sample_request_ids:
                return None
            return self.model.compute_logits(hidden)

    def _sample(self, logits: torch.Tensor, request_ids: list[str]) -> ModelRunnerOutput:
        """One token per request. logits: [num_sampled, vocab]."""
        states = [self.requests[rid] for rid in request_ids]
        sampled = self.sampler(logits, [s.sampling_state for s in states])
        output = ModelRunnerOutput(sampled_token_ids=dict(zip(request_ids, sampled.token_ids)))
        for state, token_id in zip(states, sampled.token_ids):
            state.output_token_ids.append(token_id)
        for request_id, logprobs in zip(request_ids, sampled.logprobs):
            if logprobs is not None:
                output.logprobs[request_id] = logprobs
        return output

    def _sample_and_verify(
        self, logits: torch.Tensor, request_ids: list[str], counts: list[int], scheduler_output: SchedulerOutput
    ) -> ModelRunnerOutput:
        """Rows without proposals are sampled as usual; rows with proposals are verified (speculative decoding).
        logits: [sum(counts), vocab], ``counts[i]`` rows for request i."""
        ends = list(itertools.accumulate(counts))
        plain = [i for i, c in enumerate(counts) if c == 1]
        spec = [i for i, c in enumerate(counts) if c > 1]
        output = ModelRunnerOutput()
        if plain:
            output = self._sample(logits[[ends[i] - 1 for i in plain]], [request_ids[i] for i in plain])
        drafts = {s.request_id: s.spec_token_ids for s in scheduler_output.scheduled if s.spec_token_ids}
        rows = [r for i in spec for r in range(ends[i] - counts[i], ends[i])]
        spec_ids = [request_ids[i] for i in spec]
        states = [self.requests[rid] for rid in spec_ids]
        tokens, logprobs = self.sampler.verify(logits[rows], [s.sampling_state for s in states], [drafts[r] for r in spec_ids])
        for request_id, state, emitted, lps in zip(spec_ids, states, tokens, logprobs):
            state.output_token_ids.extend(emitted)
            output.verified_token_ids[request_id] = emitted
            output.verified_logprobs[request_id] = lps
        return output

    @torch.inference_mode()
    def forward_logits(self, scheduler_output: SchedulerOutput) -> torch.Tensor:
        """Logits of every token of the batch ([T, vocab], float32) — for parity tests and scoring."""
        return self.forward_logits_raw(scheduler_output).float()

    @torch.inference_mode()
    def forward_logits_raw(self, scheduler_output: SchedulerOutput) -> torch.Tensor:
        """Logits of every token of the batch ([T, vocab]) in the model's dtype."""
        with self._distributed("logits", scheduler_output):
            batch = build_input_batch(scheduler_output, self.block_size, self.device)
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
            return self.model.compute_logits(hidden)

    def _distributed(self, kind: str, scheduler_output: SchedulerOutput):
        """Under tensor parallelism, send the other ranks what they need to run the same forward (the
        scheduled work only: they keep no request state) and report failed collectives clearly."""
        if self.tp is None:
            return contextlib.nullcontext()
        from twophase.distributed.worker import step_payload

        return self.tp.step(kind, step_payload(scheduler_output))
