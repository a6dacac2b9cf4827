"""Tiny random Llama/Qwen2 models written as HF safetensors directories and as GGUF files (tests only)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TRAINING_TEXT = """The quick brown fox jumps over the lazy dog. A tiny model reads a tiny text.
Prefill computes the prompt; decode produces one token at a time. 0123456789 + - * / = ( ) [ ] { }
def add(a, b):\n    return a + b\nHello, world! How are you today? I'm fine, thanks.
Caches hold keys and values; blocks of sixteen tokens are shared between requests with a common prefix."""


def default_model_path() -> Path | None:
    """The real default model: ``$TWOPHASE_DEFAULT_MODEL`` or the store copy; None when absent."""
    env = os.environ.get("TWOPHASE_DEFAULT_MODEL")
    if env and Path(env).exists():
        return Path(env)
    from twophase.loader import DEFAULT_MODEL, resolve

    return resolve(DEFAULT_MODEL)


def build_tiny_tokenizer(vocab_size: int = 400) -> Any:
    """A byte-level BPE trained on TRAINING_TEXT, specials at ids 0..2 (``<|endoftext|>``, ChatML)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TRAINING_TEXT] * 4, trainer=trainer)
    return tok


def write_tiny_llama(directory: Path, *, qwen2_bias: bool = False, tie: bool = True, seed: int = 0,
                     max_shard_size: str = "1GB", **overrides: Any) -> Path:
    """Write a random tiny Llama (or Qwen2 with q/k/v biases) + tokenizer as an HF directory.

    ``overrides`` replace config fields; a small ``max_shard_size`` (e.g. "40KB") writes a sharded checkpoint.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer()
    sizes = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                 rope_theta=10000.0, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    sizes.update(overrides)
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if qwen2_bias else (LlamaConfig, LlamaForCausalLM)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**sizes)).to(torch.float32).eval()
    with torch.no_grad():  # HF zero-inits biases and ones-inits norms: randomise so tests can see mistakes
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    tok.save(str(directory / "tokenizer.json"))
    tokenizer_config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": None,
                        "pad_token": "<|im_end|>", "add_bos_token": False, "chat_template": CHATML_TEMPLATE,
                        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return directory


def _forward_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf ``LlamaModel.permute``: rows [h, 2, d/2] → [h, d/2, 2]."""
    rows = weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)


def _gguf_name(hf_name: str) -> str:
    from twophase.loader.gguf_reader import GLOBAL_NAMES, LAYER_NAMES

    reverse = {v: k for k, v in GLOBAL_NAMES.items()}
    if hf_name in reverse:
        return reverse[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    part = {v: k for k, v in LAYER_NAMES.items()}[module]
    return f"blk.{layer}.{part}.{kind}"


def write_tiny_gguf(hf_dir: Path, out_path: Path, dtype: str = "f32") -> Path:
    """Write the HF model in ``hf_dir`` as GGUF (``f32``, ``f16``, ``q8_0`` or ``q4_0`` 2-D weights; norms stay f32).
    ``q4_0_as_q4_1``: the ``q4_0`` file's weights written as Q4_1 blocks (the same d and nibbles, m = -8 d)."""
    import gguf
    from safetensors.torch import load_file

    hf_dir, out_path = Path(hf_dir), Path(out_path)
    config = json.loads((hf_dir / "config.json").read_text())
    arch = "qwen2" if config["model_type"] == "qwen2" else "llama"
    writer = gguf.GGUFWriter(str(out_path), arch)
    _write_model_metadata(writer, config)
    _write_tokenizer_metadata(writer, hf_dir)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    for name, tensor in tensors.items():
        array = tensor.to(torch.float32).numpy()
        if arch == "llama" and ".q_proj." in name:
            array = _forward_permute(array, config["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            array = _forward_permute(array, config["num_key_value_heads"])
        _add_tensor(writer, _gguf_name(name), array, dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _add_tensor(writer: Any, name: str, array: np.ndarray, dtype: str) -> None:
    import gguf

    if array.ndim == 1 or dtype == "f32":
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    elif dtype == "f16":
        writer.add_tensor(name, array.astype(np.float16))
    elif dtype in ("q8_0", "q4_0"):
        qtype = gguf.GGMLQuantizationType[dtype.upper()]
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    elif dtype == "q4_0_as_q4_1":
        blocks = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q4_0).reshape(array.shape[0], -1, 18)
        minus_8d = (blocks[..., :2].copy().view(np.float16).astype(np.float32) * -8).astype(np.float16)
        q4_1 = np.concatenate([blocks[..., :2], minus_8d.view(np.uint8), blocks[..., 2:]], axis=-1)
        writer.add_tensor(name, q4_1.reshape(array.shape[0], -1), raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    else:
        raise ValueError(f"unsupported tiny GGUF dtype {dtype!r}")


def _write_model_metadata(writer: Any, config: dict[str, Any]) -> None:
    heads = config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_rope_freq_base(float(config.get("rope_theta") or config["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])


def _write_tokenizer_metadata(writer: Any, hf_dir: Path) -> None:
    import gguf

    data = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = dict(data["model"]["vocab"])
    for added in data["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    specials = {added["content"] for added in data["added_tokens"] if added["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[config["bos_token"]])
    writer.add_eos_token_id(vocab[config["eos_token"]])
    writer.add_add_bos_token(bool(config.get("add_bos_token", False)))
    writer.add_chat_template(config["chat_template"])


# token-id prompts for batching tests: shared prefixes of 2 and 3 blocks (block size 4), a 1-token prompt, repeats
MIXED_PROMPTS = [
    [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14, 8],
    [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14, 8, 100, 101, 102, 103, 104],  # shares 3 blocks with the first
    [200, 201, 202],
    [7] * 20,
    [300, 12, 45, 67, 89, 10, 11],
    [5, 17, 3, 88, 41, 9, 60, 2, 1, 1, 1, 1, 1],  # shares 2 blocks with the first
    [42],
    [250, 251, 252, 253, 254, 255, 256, 257, 258, 259, 260, 261, 262, 263, 264, 265, 266, 267, 268],
]
