"""Loader: HF safetensors dirs and GGUF files give the same HF-named tensors and the same ModelConfig."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tiny_models import write_tiny_gguf, write_tiny_llama
from twophase.config import ConfigError
from twophase.loader import ModelLoadError, ModelNotFoundError, open_model_source, pull, resolve
from twophase.loader.store import model_path, store_entry


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("llama") / "hf")


@pytest.fixture(scope="module")
def llama_gguf(llama_dir: Path) -> Path:
    return write_tiny_gguf(llama_dir, llama_dir.parent / "tiny-f32.gguf")


def _weights(model: Path) -> dict[str, torch.Tensor]:
    return dict(open_model_source(model).iter_weights(progress=False))


def test_hf_dir_config(llama_dir: Path) -> None:
    source = open_model_source(str(llama_dir))
    cfg = source.config
    assert source.format == "safetensors"
    assert (cfg.architecture, cfg.hidden_size, cfg.intermediate_size) == ("LlamaForCausalLM", 64, 128)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg.vocab_size == 400 and cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.eos_token_ids == (2,) and cfg.max_position_embeddings == 256


def test_hf_names_and_orientation(llama_dir: Path) -> None:
    weights = _weights(llama_dir)
    assert "lm_head.weight" not in weights  # tied
    assert weights["model.embed_tokens.weight"].shape == (400, 64)
    assert weights["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)  # [out, in]
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (64, 128)
    assert weights["model.norm.weight"].dtype == torch.float32


def test_sharded_safetensors(tmp_path: Path, llama_dir: Path) -> None:
    sharded = write_tiny_llama(tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a, b = _weights(sharded), _weights(llama_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_gguf_f32_equals_safetensors(llama_dir: Path, llama_gguf: Path) -> None:
    source = open_model_source(llama_gguf)
    assert source.format == "gguf"
    hf_cfg = open_model_source(llama_dir).config
    for field in ("architecture", "vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads",
                  "head_dim", "tie_word_embeddings", "bos_token_id", "eos_token_ids", "max_position_embeddings"):
        assert getattr(source.config, field) == getattr(hf_cfg, field), field
    a, b = _weights(llama_gguf), _weights(llama_dir)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == torch.float32 and torch.equal(a[name], b[name]), name


def test_gguf_q8_0_within_quant_error(llama_dir: Path, tmp_path: Path) -> None:
    a = _weights(write_tiny_gguf(llama_dir, tmp_path / "q8.gguf", dtype="q8_0"))
    b = _weights(llama_dir)
    for name in b:
        scale = b[name].abs().max().item()
        torch.testing.assert_close(a[name], b[name], atol=scale / 127 + 1e-6, rtol=0, msg=name)


def test_gguf_q4_0_dequantized_as_ggufs(llama_dir: Path, tmp_path: Path) -> None:
    """Q4_0 tensors (w = d (q - 8)) run as Q4_1 blocks with m = -8 d: the weights the loader reads (C++ kernels and
    torch alike) and the blocks the runner executes equal gguf's own dequantization of the file."""
    import gguf
    import numpy as np

    from twophase.loader import gguf_reader
    from twophase.model.ops.extension import load_kernels
    from twophase.model.ops.linear import dequantize

    path = write_tiny_gguf(llama_dir, tmp_path / "q4_0.gguf", dtype="q4_0")
    tensors = [t for t in gguf_reader.open_gguf(path).tensors if t.tensor_type.name == "Q4_0"]
    assert len(tensors) == 15  # the embedding and each layer's seven projections
    for tensor in tensors:
        expected = np.asarray(gguf.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        for kernels in (load_kernels(), None):
            assert np.array_equal(gguf_reader.dequantize_tensor(tensor, kernels), expected), tensor.name
        fmt, (qs, d, m) = gguf_reader.stored_blocks(tensor)
        assert fmt == "q4_1" and torch.equal(m.float(), -8 * d.float())
        assert np.array_equal(dequantize((qs, d, m), fmt).numpy(), expected), tensor.name
    native = open_model_source(path).native_quantized_weights()
    assert len(native) == 15 and {fmt for fmt, _ in native.values()} == {"q4_1"}
    b = _weights(llama_dir)
    for name, weight in _weights(path).items():  # within Q4_0's rounding: a step of max |w| / 8 (q is clamped at 15)
        scale = b[name].abs().max().item()
        torch.testing.assert_close(weight, b[name], atol=scale / 8 + 1e-6, rtol=0, msg=name)


def test_q4_0_scale_past_float16_range_not_native() -> None:
    """A Q4_0 block whose -8 d overflows float16 has no Q4_1 form: ``from_gguf_q4_0`` declines it (the loader then
    dequantises that tensor through gguf instead)."""
    from twophase.model.ops.quant import from_gguf_q4_0

    block = torch.zeros(18, dtype=torch.uint8)
    block[:2] = torch.tensor([10000.0], dtype=torch.float16).view(torch.uint8)
    assert from_gguf_q4_0(block, 1, 32) is None
    block[:2] = torch.tensor([-0.25], dtype=torch.float16).view(torch.uint8)
    block[2:] = 0x9F  # q 15 in the low nibbles, 9 in the high ones
    qs, d, m = from_gguf_q4_0(block, 1, 32)
    assert m.item() == 2.0 and d.item() == -0.25 and qs.shape == (1, 16)


def test_qwen2_bias_and_untied_head(tmp_path: Path) -> None:
    hf = write_tiny_llama(tmp_path / "qwen", qwen2_bias=True, tie=False, seed=1)
    gguf_path = write_tiny_gguf(hf, tmp_path / "qwen.gguf", dtype="f16")
    for model in (hf, gguf_path):
        cfg = open_model_source(model).config
        assert cfg.architecture == "Qwen2ForCausalLM" and cfg.attention_bias and not cfg.tie_word_embeddings
    a, b = _weights(gguf_path), _weights(hf)
    assert "lm_head.weight" in a and "model.layers.0.self_attn.q_proj.bias" in a
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=2e-3, rtol=1e-3, msg=name)


def test_unknown_architecture_refused(tmp_path: Path, llama_dir: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(llama_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="GPTNeoXForCausalLM"):
        open_model_source(bad)


def test_unknown_gguf_architecture_refused(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="falcon"):
        open_model_source(path)


@pytest.mark.parametrize("keep", [0.5, 0.02])
def test_truncated_gguf(tmp_path: Path, llama_gguf: Path, keep: float) -> None:
    data = llama_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match="corrupt or truncated GGUF"):
        open_model_source(cut)


def test_not_a_gguf(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(ModelLoadError, match="GGUF"):
        open_model_source(junk)


def test_truncated_safetensors(tmp_path: Path, llama_dir: Path) -> None:
    bad = tmp_path / "cut"
    shutil.copytree(llama_dir, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="corrupt or truncated safetensors"):
        open_model_source(bad)


def test_missing_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TWOPHASE_HOME", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="twophase pull smollm2-135m-instruct"):
        open_model_source("smollm2-135m-instruct")
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct"):  # lists the known names
        open_model_source(str(tmp_path / "nowhere.gguf"))
    assert resolve("smollm2-135m-instruct") is None


def test_store_unknown_name() -> None:
    with pytest.raises(ModelNotFoundError, match="known models: smollm2-135m-instruct"):
        store_entry("gpt-17")


def test_store_dir_with_gguf_opens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llama_gguf: Path) -> None:
    monkeypatch.setenv("TWOPHASE_HOME", str(tmp_path))
    target = model_path("smollm2-135m-instruct")
    target.parent.mkdir(parents=True)
    shutil.copy(llama_gguf, target)
    assert resolve("smollm2-135m-instruct") == target
    assert pull("smollm2-135m-instruct") == target  # already present: no download
    assert open_model_source("smollm2-135m-instruct").config.hidden_size == 64


def test_real_smollm2_config(default_model: Path) -> None:
    path = default_model
    cfg = open_model_source(path).config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (576, 30, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and cfg.head_dim == 64
    assert cfg.rope_theta == 100000.0 and cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1


@pytest.mark.slow
def test_real_smollm2_weights_match_transformers(default_model: Path) -> None:
    path = default_model
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    hf_cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    expected = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=LlamaForCausalLM(hf_cfg))["tensors"]
    ours = _weights(path)
    assert ours.keys() == expected.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, torch.as_tensor(expected[name]).float()), name


@pytest.mark.slow
def test_pull_downloads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TWOPHASE_HOME", str(tmp_path))
    path = pull("smollm2-135m-instruct", quiet=True)
    assert path == resolve("smollm2-135m-instruct") and path.stat().st_size > 90_000_000
    assert open_model_source("smollm2-135m-instruct").config.num_hidden_layers == 30
    assert not [p for p in path.parent.iterdir() if p != path]  # no leftovers from the download
    assert os.path.getmtime(path) == os.path.getmtime(pull("smollm2-135m-instruct"))


def test_gguf_index_cache_round_trip(llama_gguf: Path, tmp_path: Path) -> None:
    """The second open reads the cached index, and it describes the file exactly as ``GGUFReader`` does."""
    import gguf
    import numpy as np

    from twophase.loader import gguf_reader

    cold = gguf_reader.open_gguf(llama_gguf, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 1
    warm = gguf_reader.open_gguf(llama_gguf, cache_dir=tmp_path)
    reference = gguf.GGUFReader(llama_gguf)
    expected = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    for index in (cold, warm):
        assert index.metadata == expected
        assert [t.name for t in index.tensors] == [t.name for t in reference.tensors]
        for ours, theirs in zip(index.tensors, reference.tensors):
            assert ours.tensor_type == theirs.tensor_type and ours.shape == tuple(int(x) for x in theirs.shape)
            assert ours.data.dtype == theirs.data.dtype and np.array_equal(ours.data, theirs.data)
    os.utime(llama_gguf)  # a modified file gets a new entry, and the stale one is dropped
    gguf_reader.open_gguf(llama_gguf, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_real_smollm2_fast_dequantization_is_ggufs(default_model: Path) -> None:
    """Q4_1 and Q8_0 tensors dequantised through torch, and through the C++ kernels where they build, equal
    ``gguf.dequantize`` bit for bit."""
    import gguf
    import numpy as np

    from twophase.loader import gguf_reader
    from twophase.model.ops.extension import load_kernels

    kernels = load_kernels()
    if kernels is None and os.environ.get("CI"):
        raise RuntimeError("twophase C++ kernels failed to build (CI requires them)")
    tensors = gguf_reader.open_gguf(default_model).tensors
    for kind in ("Q4_1", "Q8_0"):
        tensor = next(t for t in tensors if t.tensor_type.name == kind)
        expected = np.asarray(gguf.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        assert np.array_equal(gguf_reader.dequantize_tensor(tensor), expected), tensor.name
        if kernels is not None:
            assert np.array_equal(gguf_reader.dequantize_tensor(tensor, kernels), expected), tensor.name
