"""The synchronous engine: admission, the three-line step, and the per-step records."""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import threading
import time

import logging

import torch

from twophase.config import ConfigError, EngineConfig, ModelConfig
from twophase.engine import hardware
from twophase.engine.model_runner import ModelRunner, RunnerOptions
from twophase.engine.output_processor import OutputProcessor
from twophase.engine.scheduler import Scheduler
from twophase.kv_cache.block_manager import BlockManager
from twophase.loader import open_model_source
from twophase.model.ops.linear import BLOCK_FORMATS, BLOCK_QUANTIZATIONS
from twophase.outputs import EngineStats, RequestOutput, StepRecord
from twophase.request import Request, RequestStatus
from twophase.sampling_params import InvalidRequestError, SamplingParams
from twophase.spec_decode import NgramProposer, SpeculativeConfig
from twophase.steptime.features import make_step_record
from twophase.structured import StructuredOutputSpec
from twophase.tokenizer import load_tokenizer

MAX_STEP_RECORDS = 100_000
log = logging.getLogger(__name__)


def resolve_dtype(name: str, device: torch.device, weights_in_blocks: bool = False) -> torch.dtype:
    """'auto' → float32 on a CPU when the weights are stored in GGUF blocks that float32 reads as stored
    (``weights_in_blocks``: Q8_0 / Q4_1, exact, 0.625-1.06 bytes a weight, where bfloat16 would read 2 bytes of
    rounded values); else bfloat16 on CUDA and on CPUs with bfloat16 arithmetic (AVX512-BF16 / AMX), float32 on
    other CPUs (where bfloat16 matmuls are emulated and slower than float32); otherwise the named dtype."""
    if name == "auto":
        if device.type == "cpu" and weights_in_blocks:
            return torch.float32
        fast_bf16 = device.type == "cuda" or hardware.cpu_has_fast_bf16()
        return torch.bfloat16 if fast_bf16 else torch.float32
    dtypes = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
              "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}  # fmt: skip
    if name not in dtypes:
        raise ValueError(f"unknown dtype {name!r}; choose auto, float32, bfloat16 or float16")
    return dtypes[name]


def engine_dtype(config: EngineConfig, source) -> torch.dtype:
    """The dtype the engine of ``config`` runs ``source`` in (``resolve_dtype`` with what the source stores): weights
    in GGUF blocks are those stored without quantization or as stored (gguf), and those a block format asks for
    (q8_0, q4_1), whose kernels round float32 activations to int8 blocks (bfloat16 ones would be rounded twice, and
    keep the decoder stack out)."""
    stored = config.quantization in ("none", "gguf") and source.stores_native_blocks()
    in_blocks = stored or config.quantization in BLOCK_FORMATS
    return resolve_dtype(config.dtype, torch.device(config.device), in_blocks)


def build_model_runner(config: EngineConfig, source, tp=None, progress: bool = True) -> ModelRunner:
    """The model runner of ``config`` for an opened model source (this rank's shard under ``tp``)."""
    from twophase.distributed.launch import threads_per_rank

    device = torch.device(config.device)
    if device.type == "cpu":
        torch.set_num_threads(threads_per_rank(config))
    torch.manual_seed(config.seed)
    max_model_len = min(config.scheduler.max_model_len, source.config.max_position_embeddings)
    return ModelRunner(
        source.config, functools.partial(source.iter_weights, progress=progress), config.cache, max_model_len,
        engine_dtype(config, source), device, seed=config.seed, options=runner_options(config, source),
        native_weights=source.native_quantized_weights() if wants_native_weights(config, source) else None,
        tp=tp,
    )  # fmt: skip


def wants_native_weights(config: EngineConfig, source) -> bool:
    """Whether the runner gets a GGUF file's weights as stored: for a block format asked for, and without quantization
    on CPU, where float32 weights stored as Q8_0 / Q4_1 run from their blocks, bit for bit (``BlockPanelLinear``)."""
    if config.quantization in BLOCK_QUANTIZATIONS:  # formats a GGUF file may store: its weights used as stored
        return True
    device = torch.device(config.device)
    return config.quantization == "none" and device.type == "cpu" and engine_dtype(config, source) == torch.float32


def start_model_runner(config: EngineConfig, source, progress: bool = True) -> ModelRunner:
    """Rank 0's model runner of ``config``: first starts (or joins) the other tensor-parallel ranks, which
    refuses a size the model cannot split; stops them again if loading fails. ``runner.tp`` is the group."""
    from twophase.distributed.launch import start_engine_rank

    tp = start_engine_rank(config, source.config)  # None without tensor parallelism
    try:
        return build_model_runner(config, source, tp, progress)
    except BaseException:
        if tp is not None:
            tp.close()
        raise


def resolve_gemm_dtype(config: EngineConfig, source) -> torch.dtype | None:
    """The dtype of the GEMM that projections of 8+ rows (5+ on the dot products: gemm.DOT_MIN_ROWS; prefill
    chunks, wide decode steps) run in, None for the kernels at every batch size. 'auto' → bfloat16 where ``--dtype
    auto`` chose float32 for weights stored in GGUF blocks on a CPU with bfloat16 arithmetic (AMX / AVX512-BF16):
    batch-1 decode reads the blocks exactly, the big multiplies take the bfloat16 units, as ``--dtype auto`` asks of
    such CPUs. Never under ``--deterministic`` or an explicit ``--dtype``: ``--dtype float32`` keeps the exactness
    contract."""
    name = config.gemm_dtype
    if name not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"unknown GEMM dtype {name!r}; choose auto, float32 or bfloat16")
    device = torch.device(config.device)
    usable = device.type == "cpu" and config.quantization == "none" and not config.deterministic
    usable = usable and engine_dtype(config, source) == torch.float32
    if name == "bfloat16" and not usable:
        raise ValueError("--gemm-dtype bfloat16 needs float32 weights on CPU, no quantization, not --deterministic")
    if name == "auto":
        name = "bfloat16" if usable and config.dtype == "auto" and hardware.cpu_has_fast_bf16() else "float32"
    return torch.bfloat16 if name == "bfloat16" else None


def runner_options(config: EngineConfig, source=None) -> RunnerOptions:
    """How the runners of ``config`` execute (weight format, backends, batch size, GEMM dtype for ``source``)."""
    gemm_dtype = None if source is None else resolve_gemm_dtype(config, source)
    return RunnerOptions(config.quantization, config.attention_backend, config.linear_backend,
                         config.scheduler.max_num_seqs, config.deterministic, gemm_dtype)


class LLMEngine:
    """Loads a model and steps requests through it. Not thread-safe: one caller drives ``step``."""

    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        source = open_model_source(config.model)
        self.model_config: ModelConfig = source.config
        self.tokenizer = load_tokenizer(source)
        self.device = torch.device(config.device)
        self.dtype = engine_dtype(config, source)
        max_model_len = min(config.scheduler.max_model_len, self.model_config.max_position_embeddings)
        self.scheduler_config = dataclasses.replace(config.scheduler, max_model_len=max_model_len)
        self.model_runner = start_model_runner(config, source, progress)
        self.tp = self.model_runner.tp  # None without tensor parallelism
        log.info("engine: %s", self.model_runner.describe())
        block_manager = BlockManager(
            self.model_runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.scheduler_config, block_manager)
        self.kv_connector = None  # kv_transfer.connector.KVConnector in a prefill or decode role
        if config.kv_transfer.role != "both":
            from twophase.kv_transfer.connector import KVConnector

            self.kv_connector = KVConnector(config.kv_transfer, self)
            self.scheduler.kv_connector = self.kv_connector.scheduler_side
        self.output_processor = OutputProcessor(self.tokenizer.backend)
        self.eos_token_ids = tuple(sorted(set(self.model_config.eos_token_ids) | set(self.tokenizer.eos_token_ids)))
        self.step_records: collections.deque[StepRecord] = collections.deque(maxlen=MAX_STEP_RECORDS)
        self._ids = itertools.count()
        self.speculative_config = SpeculativeConfig.parse(config.speculative_config)
        self.proposer = self._make_proposer(self.speculative_config, max_model_len, runner_options(config))
        self._grammar_compiler = None  # built on the first structured-output request
        self._grammar_lock = threading.Lock()

    def _make_proposer(self, spec: SpeculativeConfig | None, max_model_len: int, options: RunnerOptions):
        """None (speculation off), an NgramProposer, or a DraftModelProposer with its own runner and KV cache."""
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        from twophase.spec_decode.draft_model import DraftModelProposer, build_draft_runner

        runner = build_draft_runner(spec.model, self.model_runner, self.config.cache, max_model_len, self.dtype,
                                    self.device, options)  # fmt: skip
        log.info("draft model: %s", runner.describe())
        return DraftModelProposer(runner, spec.num_speculative_tokens, self.model_config.vocab_size)

    def close(self) -> None:
        """Stop tensor-parallel workers (no-op without them); the engine cannot step afterwards."""
        if self.tp is not None:
            self.tp.close()

    def watch_workers(self, on_failure) -> None:
        """Call ``on_failure(error)`` (from another thread) if a tensor-parallel worker process exits."""
        if self.tp is not None:
            self.tp.watch(on_failure)

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output the engine accepts."""
        return self.scheduler_config.max_model_len

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        detokenize: bool = True,
    ) -> Request:
        """Validate and queue a request; raises InvalidRequestError (nothing changed) on bad input."""
        request = self.make_request(prompt, params, request_id, cache_salt, arrival_time)
        self.enqueue(request, detokenize=detokenize)
        return request

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        num_ahead: int = 0,
    ) -> Request:
        """Build and fully validate a Request without touching engine state (safe from any thread).
        ``num_ahead``: requests accepted but not yet queued, counted against the waiting-queue limit."""
        params = params or SamplingParams()
        params.validate()
        params.resolve(self.model_config.vocab_size, lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        prompt_token_ids = self.tokenize_prompt(prompt)
        request = Request(
            request_id if request_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids, params, arrival_time=arrival_time, cache_salt=cache_salt,
            eos_token_ids=self.eos_token_ids,
        )  # fmt: skip
        self.scheduler.check_admission(request, num_ahead)
        if params.structured is not None:
            request.grammar = self.compile_grammar(params.structured)
        return request

    def compile_grammar(self, spec: StructuredOutputSpec) -> object:
        """The compiled grammar of a structured-output spec (cached; thread-safe; InvalidRequestError when the
        schema, regex or grammar is invalid). The first call builds xgrammar's view of the tokenizer."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                from twophase.structured.grammar import GrammarCompiler, tokenizer_info

                info = tokenizer_info(self.tokenizer.backend, self.model_config.vocab_size, self.eos_token_ids)
                self._grammar_compiler = GrammarCompiler(info)
        return self._grammar_compiler.compile(spec)

    def enqueue(self, request: Request, detokenize: bool = True) -> None:
        """Queue a request made by ``make_request`` (mutates the scheduler: call from the stepping thread)."""
        self.scheduler.add_request(request)  # may raise: nothing is queued yet
        self.output_processor.add_request(request, detokenize=detokenize)

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text prompt, or validated caller-given ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", "prompt")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})", "prompt")
        return ids

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a waiting or running request and free its blocks at once."""
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        if request is None:
            return None
        return self.output_processor.abort(request)

    def has_unfinished_requests(self) -> bool:
        """True while anything waits or runs."""
        return self.scheduler.has_unfinished

    def idle_work(self) -> bool:
        """One short piece of work for a loop with no step to run: map a slice of the KV cache's pages ahead of
        their first write (~16 ms at most). False when none is left (the loop may then sleep)."""
        return self.model_runner.prefault_kv_cache()

    def stats(self) -> EngineStats:
        """Current gauges and counters."""
        bm = self.scheduler.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_blocks_in_use=bm.num_blocks_in_use,
            num_blocks_total=bm.num_blocks,
            prefix_cache_queries=bm.stats.num_queries,
            prefix_cache_hits=bm.stats.num_hits,
            num_preemptions=self.scheduler.num_preemptions,
            spec_decode=self.scheduler.spec_stats.copy() if self.proposer else None,
        )

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and turn the results into outputs."""
        start = time.monotonic()
        failed = self.kv_connector.apply_finished(self) if self.kv_connector else []  # remote K/V arrived or not
        self._propose()
        scheduler_output = self.scheduler.schedule()
        if self.kv_connector:
            self.kv_connector.start_loads()
        runner_output = self.model_runner.execute(scheduler_output)
        updates = self.scheduler.update(scheduler_output, runner_output)
        outputs = failed + [self._finish_output(update) for update in updates]
        self._record_step(scheduler_output, start, updates)
        return outputs

    def _propose(self) -> None:
        """Speculative decoding: proposals for every running request about to decode."""
        if self.proposer is None:
            return
        running = self.scheduler.running
        decoding = [r for r in running if r.num_output_tokens > 0 and r.num_tokens - r.num_computed_tokens == 1]
        proposals = self.proposer.propose_all(decoding)
        for request in running:
            request.spec_token_ids = proposals.get(request.request_id, [])

    def _finish_output(self, update) -> RequestOutput:
        output, stop_hit = self.output_processor.process(update)
        if stop_hit:
            self.scheduler.finish_request(update.request.request_id, RequestStatus.FINISHED_STOPPED)
        return output

    def _record_step(self, scheduler_output, start: float, updates: list) -> None:
        if not scheduler_output.scheduled and not scheduler_output.preempted_request_ids:
            return
        self.step_records.append(make_step_record(scheduler_output, self.scheduler, start, time.monotonic() - start,
                                                  updates))  # fmt: skip
