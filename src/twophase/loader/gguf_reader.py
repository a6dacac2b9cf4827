"""GGUF files: metadata → ModelConfig, tensors → dequantized float32 under HF names.

llama.cpp's converter permutes the rows of llama-arch q/k projections (to interleave the rotary
halves); we undo it exactly as HF transformers' GGUF loader does, so weights come back in HF layout.

``gguf.GGUFReader`` parses every metadata field into numpy views, which takes seconds for a 49k-token
vocabulary. ``open_gguf`` therefore keeps what it parsed (metadata values, tensor names, types and offsets)
as JSON under ``$TWOPHASE_HOME/cache/gguf/``, keyed by the file's path, size and modification time; a
later process memory-maps the tensors straight from those offsets.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, dequantize

from twophase.config import ConfigError, ModelConfig
from twophase.loader.errors import ModelLoadError
from twophase.model.ops import quant

CACHE_VERSION = 1  # bump when the cached index's layout changes

GGUF_MAGIC = b"GGUF"

# general.architecture → HF architecture
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# architectures whose q/k rows llama.cpp's converter permuted (its LlamaModel.permute)
PERMUTED_ARCHITECTURES = ("llama", "mistral")

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def is_gguf_file(path: Path) -> bool:
    """True when the file starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == GGUF_MAGIC
    except OSError:
        return False


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its stored bytes as a memory-mapped numpy view (as ``GGUFReader`` shapes it)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file: metadata values as Python objects and its tensors."""

    path: Path
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


def open_gguf(path: Path, cache_dir: Path | None = None) -> GGUFFile:
    """Parse a GGUF file (memory-mapped), through the metadata cache in ``cache_dir`` (default
    ``$TWOPHASE_HOME/cache/gguf``); corrupt or truncated files raise ModelLoadError."""
    if not is_gguf_file(path):
        raise ModelLoadError(f"corrupt GGUF file {path}: missing GGUF magic bytes")
    cache_file = _cache_file(path, cache_dir)
    index = _read_index(cache_file)
    if index is None:
        index = _parse_index(path)
        _write_index(cache_file, index)
    return _file_from_index(path, index)


def _parse_index(path: Path) -> dict[str, Any]:
    """Metadata values and tensor locations of ``path``, parsed by ``GGUFReader`` and checked for truncation."""
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # the gguf parser fails with ValueError/IndexError/... deep inside numpy
        raise ModelLoadError(f"corrupt or truncated GGUF file {path}: {exc}") from exc
    file_size = path.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > file_size or tensor.data.nbytes != tensor.n_bytes:
            raise ModelLoadError(f"corrupt or truncated GGUF file {path}: tensor {tensor.name} runs past the end")
    metadata = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    tensors = [{"name": t.name, "type": int(t.tensor_type), "shape": [int(x) for x in t.shape],
                "dtype": t.data.dtype.str, "data_shape": list(t.data.shape), "offset": int(t.data_offset)}
               for t in reader.tensors]
    return {"metadata": metadata, "tensors": tensors}


def _file_from_index(path: Path, index: dict[str, Any]) -> GGUFFile:
    mapped = np.memmap(path, mode="r")
    tensors = [GGUFTensor(name=t["name"], tensor_type=GGMLQuantizationType(t["type"]), shape=tuple(t["shape"]),
                          data=np.ndarray(tuple(t["data_shape"]), np.dtype(t["dtype"]), mapped, t["offset"]))
               for t in index["tensors"]]
    return GGUFFile(path=path, metadata=index["metadata"], tensors=tensors)


def _cache_file(path: Path, cache_dir: Path | None) -> Path:
    from twophase.loader.store import store_home

    stat = path.stat()
    key = f"{CACHE_VERSION}|{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return (cache_dir or store_home() / "cache" / "gguf") / f"{path.stem}-{digest}.json"


def _read_index(cache_file: Path) -> dict[str, Any] | None:
    try:
        return json.loads(cache_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # absent or damaged: parse the file again


def _write_index(cache_file: Path, index: dict[str, Any]) -> None:
    """Write atomically, replacing older entries of the same file name (the cache holds one entry per name, so
    temporary files do not pile up); a read-only home only costs the next process a re-parse."""
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        stem = cache_file.name.rsplit("-", 1)[0]
        for stale in cache_file.parent.glob(f"{glob.escape(stem)}-*.json"):
            if stale.name.rsplit("-", 1)[0] == stem:
                stale.unlink(missing_ok=True)
        partial = cache_file.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(index), encoding="utf-8")
        partial.replace(cache_file)
    except OSError:
        pass


def gguf_field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """A metadata value as a Python object (str, int, float, bool, list), or ``default``."""
    return reader.metadata.get(key, default)


def gguf_architecture(reader: GGUFFile) -> str:
    """``general.architecture``, refused with ConfigError when twophase cannot run it."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(GGUF_ARCHITECTURES)
        raise ConfigError(f"unsupported GGUF architecture {arch!r}; twophase supports {supported}")
    return arch


def gguf_config(reader: GGUFFile) -> ModelConfig:
    """Normalise GGUF metadata into a ModelConfig (via the equivalent HF config dict)."""
    arch = gguf_architecture(reader)
    names = {tensor.name for tensor in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ConfigError("GGUF rope_freqs (Llama 3.1-style rope scaling) is not supported yet")

    def key(suffix: str, default: Any = None) -> Any:
        return gguf_field(reader, f"{arch}.{suffix}", default)

    required = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
    missing = [name for name in required if key(name) is None]
    if missing:
        raise ModelLoadError(f"GGUF metadata lacks {', '.join(f'{arch}.{m}' for m in missing)}")
    num_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    vocab_size = key("vocab_size") or (len(tokens) if tokens is not None else _embedding_rows(reader))
    eos_ids = [gguf_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    hf = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(key("attention.head_count_kv", num_heads)),
        "head_dim": int(key("attention.key_length", hidden // num_heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(key),
        "max_position_embeddings": int(key("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(int(e) for e in eos_ids if e is not None)),
        "torch_dtype": "float32",
    }
    return ModelConfig.from_hf_dict(hf)


def _embedding_rows(reader: GGUFFile) -> int:
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])  # GGUF shapes are reversed: [hidden, vocab]
    raise ModelLoadError("GGUF file has neither a vocabulary nor token_embd.weight")


def _rope_scaling(key: Any) -> dict[str, Any] | None:
    kind = key("rope.scaling.type")
    factor = key("rope.scaling.factor") or key("rope.scale_linear")
    if kind in (None, "none") and factor is None:
        return None
    scaling: dict[str, Any] = {"rope_type": kind or "linear", "factor": float(factor or 1.0)}
    original = key("rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def hf_name(gguf_name: str) -> str:
    """Map a llama.cpp tensor name to its HF name; unknown names raise ModelLoadError."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match and match.group(2) in LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{LAYER_NAMES[part]}.{kind}"
    raise ModelLoadError(f"unexpected tensor {gguf_name!r} in GGUF file")


def reverse_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (rows [h, 2, d/2] ← [h, d/2, 2]); works for biases too."""
    half = weight.shape[0] // num_heads // 2
    rows = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return rows.swapaxes(2, 1).reshape(weight.shape)


def iter_gguf(reader: GGUFFile, config: ModelConfig, tensors: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor [out, in])`` for each GGUF tensor in ``tensors``."""
    from twophase.model.ops.extension import built_kernels

    permute = gguf_architecture(reader) in PERMUTED_ARCHITECTURES
    kernels = built_kernels()
    for tensor in tensors:
        name = hf_name(tensor.name)
        array = dequantize_tensor(tensor, kernels)
        if permute and ".attn_q." in tensor.name:
            array = reverse_permute(array, config.num_attention_heads)
        elif permute and ".attn_k." in tensor.name:
            array = reverse_permute(array, config.num_key_value_heads)
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, dtype=np.float32, order="C")
        yield name, torch.from_numpy(array)


# GGUF tensor types our kernels execute as stored -> the block format each runs as (``quant.FROM_GGUF``)
NATIVE_FORMATS = {type_name: fmt for type_name, (fmt, _) in quant.FROM_GGUF.items()}
# those stored in their own format's block layout, which the C++ kernels' ``dequantize_gguf`` reads in place
RAW_DEQUANTIZED = tuple(type_name for type_name, fmt in NATIVE_FORMATS.items() if fmt == type_name.lower())


def stored_blocks(tensor: GGUFTensor) -> tuple[str, tuple[torch.Tensor, ...]] | None:
    """(block format, its tensors in ``model/ops/quant.py``'s layout) of a 2-D tensor stored in a type the kernels
    execute (``NATIVE_FORMATS``), rows in the stored order; None for any other tensor, and for a Q4_0 one that no
    Q4_1 block can hold (``quant.from_gguf_q4_0``)."""
    entry = quant.FROM_GGUF.get(tensor.tensor_type.name)
    if entry is None or len(tensor.shape) != 2:
        return None
    fmt, from_gguf = entry
    k, n = (int(x) for x in tensor.shape)  # GGUF lists dimensions innermost first
    packed = from_gguf(raw_block_bytes(tensor), n, k)
    return None if packed is None else (fmt, packed)


def dequantize_tensor(tensor: GGUFTensor, kernels: ModuleType | None = None) -> np.ndarray:
    """float32 values of a GGUF tensor in its stored row order. The block types the kernels execute
    (``NATIVE_FORMATS``) go through the C++ ``kernels`` when given (``extension.built_kernels()``; Q8_0 and Q4_1
    read in place), else through torch (``model/ops/quant.py``): both give ``gguf.dequantize``'s values many times
    faster (its bits for Q8_0 and Q4_1, the same arithmetic; for Q4_0, +0 where gguf gives -0, see
    ``quant.from_gguf_q4_0``). Every other type goes through ``gguf.dequantize``."""
    type_name = tensor.tensor_type.name
    if kernels is not None and type_name in RAW_DEQUANTIZED and len(tensor.shape) == 2:
        k, n = (int(x) for x in tensor.shape)
        return kernels.dequantize_gguf(raw_block_bytes(tensor), NATIVE_FORMATS[type_name], n, k).numpy()
    blocks = stored_blocks(tensor)
    if blocks is not None:
        from twophase.model.ops.linear import dequantize as dequantize_packed

        fmt, packed = blocks
        return (kernels.dequantize_blocks(fmt, list(packed)) if kernels is not None
                else dequantize_packed(packed, fmt)).numpy()  # fmt: skip
    try:
        return np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    except Exception as exc:
        raise ModelLoadError(f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {exc}") from exc


def raw_block_bytes(tensor: GGUFTensor) -> torch.Tensor:
    """A GGUF tensor's stored bytes as a flat uint8 tensor over the memory-mapped file, not copied: its readers
    (``quant.from_gguf_*``, the kernels' ``dequantize_gguf``) copy out what they keep and never write to it."""
    data = np.asarray(tensor.data).view(np.uint8).reshape(-1)
    with warnings.catch_warnings():  # torch warns that a read-only array's tensor must not be written: it is not
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(data)


def iter_gguf_native(reader: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, str, tuple[torch.Tensor, ...]]]:
    """Yield ``(hf_name, fmt, packed)`` for each 2-D tensor stored in a block type our kernels run (``stored_blocks``:
    Q8_0 and Q4_1, Q4_0 as Q4_1), as the tensors its kernel takes (``model/ops/quant.py`` layouts), rows in HF order:
    the exact stored weights, never dequantised and requantised."""
    permute = gguf_architecture(reader) in PERMUTED_ARCHITECTURES
    for tensor in reader.tensors:
        blocks = stored_blocks(tensor)
        if blocks is None:
            continue
        fmt, packed = blocks
        if permute and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            heads = config.num_attention_heads if ".attn_q." in tensor.name else config.num_key_value_heads
            packed = tuple(torch.from_numpy(np.ascontiguousarray(reverse_permute(p.numpy(), heads))) for p in packed)
        yield hf_name(tensor.name), fmt, packed
