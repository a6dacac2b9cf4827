"""``Tokenizer``: a ``tokenizers.Tokenizer`` plus special tokens and the chat template.

Built from an HF directory's ``tokenizer.json`` + ``tokenizer_config.json``, or from GGUF vocabulary
metadata (``tokenizer.ggml.*``), reproducing the tokenizer HF transformers builds from the same file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from twophase.sampling_params import InvalidRequestError
from twophase.tokenizer.chat_template import compile_template, render_chat, validate_messages

if TYPE_CHECKING:
    from twophase.loader import ModelSource

# End-of-turn tokens: added to eos_token_ids when the chat template writes them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
CONTROL = 3  # llama.cpp token type
USER_DEFINED = 4

# Split regexes by ``tokenizer.ggml.pre`` (same table as transformers' GGUF tokenizer mapping).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}


class Tokenizer:
    """Text ↔ token ids, special tokens and chat template of one model."""

    def __init__(self, backend: BackendTokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 add_bos: bool = False, chat_template: str | None = None, eos_token_ids: tuple[int, ...] = (),
                 special_tokens: dict[str, str | None] | None = None) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.special_tokens = {"bos_token": bos_token, "eos_token": eos_token, **(special_tokens or {})}
        self._compiled: jinja2.Template | None = None
        self._prepend_bos = add_bos and self.bos_token_id is not None and not self._post_processor_adds_bos()
        ids = [*eos_token_ids, self.token_to_id(eos_token)]
        ids += [self.token_to_id(t) for t in END_OF_TURN_TOKENS if chat_template and t in chat_template]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in ids if i is not None))

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        """Id of the BOS token (None when the model has none)."""
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        """Id of the primary EOS token."""
        return self.token_to_id(self.eos_token)

    @property
    def has_chat_template(self) -> bool:
        """True when the model ships a chat template."""
        return bool(self.chat_template)

    def token_to_id(self, token: str | None) -> int | None:
        """Id of a token string, or None."""
        return None if token is None else self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Raw vocabulary string of an id (byte-level spelling for BPE vocabularies)."""
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS when the model wants it.

        Encode a rendered chat prompt with ``add_special_tokens=False``: templates write BOS themselves.
        """
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **extra: Any) -> str:
        """Render chat messages to a prompt string (InvalidRequestError on bad messages or template)."""
        checked = validate_messages(messages)
        if chat_template is not None:
            template = compile_template(chat_template)
        elif self.chat_template:
            self._compiled = self._compiled or compile_template(self.chat_template)
            template = self._compiled
        else:
            raise InvalidRequestError("this model has no chat template; pass chat_template", "chat_template")
        return render_chat(template, checked, add_generation_prompt=add_generation_prompt,
                           special_tokens=self.special_tokens, **extra)

    def _post_processor_adds_bos(self) -> bool:
        ids = self.backend.encode("a", add_special_tokens=True).ids
        return bool(ids) and ids[0] == self.bos_token_id


def load_tokenizer(source: ModelSource) -> Tokenizer:
    """The tokenizer of a model source (HF directory files, or GGUF vocabulary metadata)."""
    if source.format == "gguf":
        return tokenizer_from_gguf(source)
    return tokenizer_from_hf_dir(source.directory, eos_token_ids=source.config.eos_token_ids)


def tokenizer_from_hf_dir(directory: Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
    """Load ``tokenizer.json`` and ``tokenizer_config.json`` (+ ``chat_template.jinja``) of an HF directory."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no tokenizer.json (slow sentencepiece tokenizers are not supported)")
    backend = BackendTokenizer.from_file(str(path))
    config = _read_json(directory / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    generation = _read_json(directory / "generation_config.json").get("eos_token_id")
    extra_eos = generation if isinstance(generation, list) else [generation] if generation is not None else []
    names = ("unk_token", "pad_token")
    return Tokenizer(
        backend,
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
        add_bos=bool(config.get("add_bos_token", False)),
        chat_template=template,
        eos_token_ids=tuple(eos_token_ids) + tuple(int(e) for e in extra_eos),
        special_tokens={name: _token_text(config.get(name)) for name in names},
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def _token_text(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def tokenizer_from_gguf(source: ModelSource) -> Tokenizer:
    """Build the tokenizer a GGUF file describes (``gpt2`` byte-level BPE vocabularies)."""
    kind = source.metadata("tokenizer.ggml.model")
    tokens: list[str] = source.metadata("tokenizer.ggml.tokens") or []
    if kind != "gpt2" or not tokens:
        raise ValueError(f"cannot build a tokenizer from GGUF vocabulary type {kind!r}; only 'gpt2' (byte-level BPE) "
                         "is supported -- use the model's HF directory with tokenizer.json instead")
    types: list[int] = source.metadata("tokenizer.ggml.token_type") or [1] * len(tokens)
    backend = _byte_level_bpe(tokens, source.metadata("tokenizer.ggml.merges") or [])
    pre = source.metadata("tokenizer.ggml.pre")
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)

    def token_of(key: str) -> str | None:
        token_id = source.metadata(f"tokenizer.ggml.{key}_token_id")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, k in zip(tokens, types) if k == CONTROL and set(t) <= alphabet])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, k in zip(tokens, types) if k == USER_DEFINED])
    bos = token_of("bos")
    add_bos = bool(source.metadata("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])
    return Tokenizer(
        backend, bos_token=bos, eos_token=token_of("eos"), add_bos=add_bos,
        chat_template=source.metadata("tokenizer.chat_template"), eos_token_ids=source.config.eos_token_ids,
        special_tokens={"unk_token": token_of("unknown"), "pad_token": token_of("padding")},
    )


def _byte_level_bpe(tokens: list[str], merges: list[str]) -> BackendTokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """GPT-2 splitting by default; the model's own split regex when ``tokenizer.ggml.pre`` names one."""
    if pre == "smollm":  # SmolLM's tokenizer.json: every digit alone, then GPT-2 byte-level splitting
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    split = PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
