"""xgrammar behind three small objects: ``GrammarCompiler`` (spec → compiled grammar, cached), ``Matcher``
(one request's position in its grammar) and ``apply_bitmasks`` (the batched sampler's per-row masks).

Compiling happens at admission (``LLMEngine.make_request``; the server does it in a worker thread first), never
inside a step: the step only fills bitmasks and advances matchers.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import torch
import xgrammar as xgr

from twophase.sampling_params import InvalidRequestError
from twophase.structured.spec import StructuredOutputSpec

MAX_CACHED_GRAMMARS = 256


def tokenizer_info(backend, vocab_size: int, stop_token_ids: tuple[int, ...]) -> xgr.TokenizerInfo:
    """xgrammar's view of a ``tokenizers.Tokenizer``: its vocabulary (as stored), how tokens spell bytes, and the
    ids that end a generation. ``vocab_size``: the model's logits width (may exceed the tokenizer's)."""
    num_tokens = min(backend.get_vocab_size(with_added_tokens=True), vocab_size)
    vocab = [backend.id_to_token(i) or "" for i in range(num_tokens)]
    spec = json.loads(backend.to_str())
    vocab_type, add_prefix_space = _vocab_type(spec)
    return xgr.TokenizerInfo(vocab, vocab_type, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids),
                             add_prefix_space=add_prefix_space)


def _vocab_type(spec: dict) -> tuple[xgr.VocabType, bool]:
    """Byte-level BPE (GPT-2 style), SentencePiece byte fallback (``▁`` and ``<0x..>``), or raw strings."""
    decoder = spec.get("decoder") or {}
    parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    types = {part.get("type") for part in parts}
    if "ByteLevel" in types:
        return xgr.VocabType.BYTE_LEVEL, False
    if "ByteFallback" in types:
        return xgr.VocabType.BYTE_FALLBACK, "▁" in json.dumps(spec.get("normalizer") or spec.get("pre_tokenizer"))
    return xgr.VocabType.RAW, False


class GrammarCompiler:
    """Compiles specs against one tokenizer; compiled grammars are cached by spec (LRU). Thread-safe."""

    def __init__(self, info: xgr.TokenizerInfo, max_threads: int = 2) -> None:
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads)
        self.vocab_size = info.vocab_size
        self._cache: OrderedDict[StructuredOutputSpec, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec``; an invalid schema / regex / grammar raises InvalidRequestError."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        try:
            compiled = self.compiler.compile_grammar(self._grammar(spec))
        except (RuntimeError, ValueError, TypeError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            reason = re.sub(r"^\[[\d:]+\] \S+: ", "", reason)  # drop xgrammar's "[time] file.cc:line: " prefix
            raise InvalidRequestError(f"{spec.param}: invalid {spec.kind} constraint: {reason}", spec.param) from exc
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def _grammar(self, spec: StructuredOutputSpec) -> xgr.Grammar:
        grammar = _inner_grammar(spec)
        if spec.prefix or spec.suffix:
            parts = [_literal(spec.prefix)] if spec.prefix else []
            parts.append(grammar)
            parts += [_literal(spec.suffix)] if spec.suffix else []
            grammar = xgr.Grammar.concat(*parts)
        return grammar


def _inner_grammar(spec: StructuredOutputSpec) -> xgr.Grammar:
    if spec.kind == "json":
        return xgr.Grammar.from_json_schema(spec.value, any_whitespace=False)
    if spec.kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.value)
    if spec.kind == "choice":
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_string(c) for c in json.loads(spec.value)))
    return xgr.Grammar.from_ebnf(spec.value)


def _literal(text: str) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf(f"root ::= {_ebnf_string(text)}")


def _ebnf_string(text: str) -> str:
    """An EBNF string literal (JSON escapes are EBNF escapes)."""
    return json.dumps(text, ensure_ascii=False)


class Matcher:
    """One request's progress through its grammar (one per choice). Owned by the runner's sampling state."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` ([rows, ceil(vocab / 32)] int32)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar refuses it (it was masked, so never expected)."""
        if self.matcher.is_terminated():
            return False
        return self.matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        """True once the grammar is complete and its stop token accepted."""
        return self.matcher.is_terminated()


def apply_bitmasks(logits: torch.Tensor, matchers: dict[int, Matcher]) -> None:
    """Mask, in place, every token row ``i``'s grammar forbids next. logits: [num_reqs, vocab] float32."""
    rows = [i for i, m in matchers.items() if not m.terminated]
    if not rows:
        return
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])  # [num_reqs, ceil(vocab / 32)]
    for i in rows:
        matchers[i].fill_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
