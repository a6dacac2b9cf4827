"""GGUF files: metadata → ModelConfig, tensors → dequantized float32 under HF names.

llama.cpp's converter permutes the rows of llama-arch q/k projections (to interleave the rotary
halves); we undo it exactly as HF transformers' GGUF loader does, so weights come back in HF layout.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, dequantize

from twophase.config import ConfigError, ModelConfig
from twophase.loader.errors import ModelLoadError

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


def open_gguf(path: Path) -> GGUFReader:
    """Parse a GGUF file (memory-mapped); corrupt or truncated files raise ModelLoadError."""
    if not is_gguf_file(path):
        raise ModelLoadError(f"corrupt GGUF file {path}: missing GGUF magic bytes")
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # the gguf parser fails with ValueError/IndexError/... deep inside numpy
        raise ModelLoadError(f"corrupt or truncated GGUF file {path}: {exc}") from exc
    file_size = path.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > file_size or tensor.data.nbytes != tensor.n_bytes:
            raise ModelLoadError(f"corrupt or truncated GGUF file {path}: tensor {tensor.name} runs past the end")
    return reader


def gguf_field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as a Python object (str, int, float, bool, list), or ``default``."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_architecture(reader: GGUFReader) -> str:
    """``general.architecture``, refused with ConfigError when twophase cannot run it."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(GGUF_ARCHITECTURES)
        raise ConfigError(f"unsupported GGUF architecture {arch!r}; twophase supports {supported}")
    return arch


def gguf_config(reader: GGUFReader) -> ModelConfig:
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
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = key("vocab_size") or (len(tokens.data) if tokens is not None else _embedding_rows(reader))
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


def _embedding_rows(reader: GGUFReader) -> int:
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


def iter_gguf(reader: GGUFReader, config: ModelConfig, tensors: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor [out, in])`` for each GGUF tensor in ``tensors``."""
    permute = gguf_architecture(reader) in PERMUTED_ARCHITECTURES
    for tensor in tensors:
        name = hf_name(tensor.name)
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise ModelLoadError(f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {exc}") from exc
        array = np.asarray(array, dtype=np.float32)
        if permute and ".attn_q." in tensor.name:
            array = reverse_permute(array, config.num_attention_heads)
        elif permute and ".attn_k." in tensor.name:
            array = reverse_permute(array, config.num_key_value_heads)
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, dtype=np.float32, order="C")
        yield name, torch.from_numpy(array)


NATIVE_FORMATS = {"Q8_0": "q8_0", "Q4_1": "q4_1"}  # GGUF tensor types our kernels execute as stored


def iter_gguf_native(reader: GGUFReader, config: ModelConfig) -> Iterator[tuple[str, str, tuple[torch.Tensor, ...]]]:
    """Yield ``(hf_name, fmt, packed)`` for each 2-D tensor stored in a block format our kernels run (q8_0, q4_1),
    as the tensors its kernel takes (``model/ops/quant.py`` layouts), rows in HF order: the exact stored weights,
    never dequantised and requantised."""
    from twophase.model.ops import quant

    permute = gguf_architecture(reader) in PERMUTED_ARCHITECTURES
    for tensor in reader.tensors:
        fmt = NATIVE_FORMATS.get(tensor.tensor_type.name)
        if fmt is None or len(tensor.shape) != 2:
            continue
        k, n = (int(x) for x in tensor.shape)  # GGUF lists dimensions innermost first
        raw = torch.from_numpy(np.array(tensor.data, copy=True).view(np.uint8).reshape(-1))
        packed = quant.from_gguf_q8_0(raw, n, k) if fmt == "q8_0" else quant.from_gguf_q4_1(raw, n, k)
        if permute and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            heads = config.num_attention_heads if ".attn_q." in tensor.name else config.num_key_value_heads
            packed = tuple(torch.from_numpy(np.ascontiguousarray(reverse_permute(p.numpy(), heads))) for p in packed)
        yield hf_name(tensor.name), fmt, packed
