"""Bad input to the offline API and the CLI: a clear error naming the field, raised before any state changes;
requests already in flight are unaffected."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from twophase import LLM, InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), progress=False, block_size=4, num_blocks=64, max_model_len=64)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1.0), ("temperature", math.nan), ("temperature", math.inf),
        ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan), ("top_k", -3), ("min_p", -0.1), ("min_p", 2.0),
        ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("presence_penalty", math.inf),
        ("frequency_penalty", -5.0), ("max_tokens", 0), ("max_tokens", -1), ("min_tokens", -1), ("n", 0),
        ("logprobs", -1), ("seed", 1.5), ("seed", 2**70), ("stop", [""]), ("stop_token_ids", [-1]),
    ],
)  # fmt: skip
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
    assert field in str(info.value)


def test_min_tokens_above_max_tokens():
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)


@pytest.mark.parametrize(
    "prompt,params,param,match",
    [
        ("", SamplingParams(), "prompt", "empty"),
        ([], SamplingParams(), "prompt", "empty"),
        ([1, 2, 10_000], SamplingParams(), "prompt", "vocabulary"),
        ([1, -2], SamplingParams(), "prompt", "vocabulary"),
        ([5] * 70, SamplingParams(max_tokens=1), "prompt", "context length"),
        ([5] * 40, SamplingParams(max_tokens=40), "max_tokens", "context length"),
    ],
)
def test_bad_requests_rejected_before_state_changes(llm, prompt, params, param, match):
    engine = llm.engine
    good = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    before = (len(engine.scheduler.requests), engine.scheduler.block_manager.num_blocks_in_use)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(prompt, params)
    assert info.value.param == param
    assert match in str(info.value)
    assert (len(engine.scheduler.requests), engine.scheduler.block_manager.num_blocks_in_use) == before
    engine.scheduler.check_invariants()
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == good.request_id and out.finished:
                final = out
    assert final is not None and len(final.token_ids) == 8


def test_generate_validates_every_prompt_before_queuing_any(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([[5, 6, 7], ""], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


def test_unknown_model_path():
    with pytest.raises(FileNotFoundError, match="twophase pull"):
        LLM("/nonexistent/model/dir", progress=False)


def test_truncated_gguf(tiny_llama_gguf, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(tiny_llama_gguf.read_bytes()[:5000])
    with pytest.raises(Exception, match="(?i)corrupt or truncated"):
        LLM(str(broken), progress=False)


def test_truncated_safetensors(tiny_llama_dir, tmp_path):
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, copy)
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:2000])
    with pytest.raises(Exception, match="(?i)corrupt or truncated"):
        LLM(str(copy), progress=False)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "twophase.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["generate", "--model", "/nonexistent.gguf", "hi"], "twophase pull"),
        (["generate", "--temperature", "nan", "hi"], "temperature"),
        (["generate", "--top-p", "0", "hi"], "top_p"),
        (["generate", "--max-tokens", "-4", "hi"], "max_tokens"),
        (["generate", ""], "prompt"),
    ],
)
def test_cli_errors_are_one_line(args, needle):
    result = run_cli(*args)
    assert result.returncode == 2
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("twophase: error:") and needle in lines[0]
    assert "Traceback" not in result.stderr
