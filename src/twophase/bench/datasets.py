"""Workloads for `twophase bench serve`: random, prefix-repetition, sharegpt and custom.

Prompts need token counts, so every workload goes through a ``TokenCounter``. Which one is used (in order):

1. ``--tokenizer PATH|NAME``: twophase's own tokenizer (tokenizer.json directory, .gguf or store name) — exact.
2. The server's ``POST /tokenize`` and ``POST /detokenize`` (vLLM's and twophase's extension) — exact.
3. ``WordCounter``: one common English word ≈ one token (" the", " cat" are single BPE tokens in most
   vocabularies) — approximate. The benchmark then reports the server's ``usage.prompt_tokens`` anyway.

Random prompts are built from random common words rather than random token ids: the words are tokenized, the
ids cut to the target length and decoded again, so no special or partial-UTF-8 tokens end up in a prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx
import numpy as np

WORDS = (
    "the of and to in is was for on that with as by at from his her an were are which this be or had not but "
    "one have first new after who they time their two has all year been would more city its other can when "
    "most people world over into some many school state only three work made used during where then known may "
    "than film such part later between these water about while under both well music team through game before "
    "house life each since place long group name day great small same any high end back good old power light "
    "river land south north west east book family story children market paper garden window morning question"
).split()


@dataclass
class SampleRequest:
    """One benchmark request: the prompt text, its token count and the number of tokens to generate."""

    prompt: str
    prompt_len: int
    expected_output_len: int


class TokenCounter(Protocol):
    """Turns text into token ids and back (ids only need to be meaningful to the same counter)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class WordCounter:
    """Approximate counter: one whitespace-separated word is one token (ids index the word list)."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._words: list[str] = []

    def encode(self, text: str) -> list[int]:
        """Word ids; a new word gets the next id."""
        ids = []
        for word in text.split():
            if word not in self._ids:
                self._ids[word] = len(self._words)
                self._words.append(word)
            ids.append(self._ids[word])
        return ids

    def decode(self, ids: list[int]) -> str:
        """Words joined by spaces."""
        return " ".join(self._words[i] for i in ids)


class LocalCounter:
    """twophase's tokenizer, loaded from a tokenizer.json directory, a .gguf file or a store name."""

    def __init__(self, name_or_path: str) -> None:
        from twophase.loader import open_model_source, resolve
        from twophase.tokenizer.tokenizer import load_tokenizer

        path = resolve(name_or_path) or Path(name_or_path)
        self.tokenizer = load_tokenizer(open_model_source(path))

    def encode(self, text: str) -> list[int]:
        """Ids without special tokens."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """Text of the ids."""
        return self.tokenizer.decode(ids)


class ServerCounter:
    """The server's /tokenize and /detokenize endpoints (vLLM's request and response shapes)."""

    def __init__(self, base_url: str, model: str, client: httpx.Client | None = None) -> None:
        self.base_url, self.model = base_url.rstrip("/"), model
        self.client = client or httpx.Client(timeout=60)

    def encode(self, text: str) -> list[int]:
        """POST /tokenize {model, prompt, add_special_tokens: false} → tokens."""
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        response = self.client.post(f"{self.base_url}/tokenize", json=body)
        response.raise_for_status()
        return list(response.json()["tokens"])

    def decode(self, ids: list[int]) -> str:
        """POST /detokenize {model, tokens} → prompt."""
        response = self.client.post(f"{self.base_url}/detokenize", json={"model": self.model, "tokens": ids})
        response.raise_for_status()
        return str(response.json()["prompt"])

    def available(self) -> bool:
        """True when both endpoints answer a round trip."""
        try:
            return bool(self.decode(self.encode("hello world")))
        except (httpx.HTTPError, KeyError, ValueError):
            return False


def sampled_lengths(length: int, range_ratio: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """n integer lengths uniform on [⌊L(1−r)⌋, ⌈L(1+r)⌉] (vLLM's --random-range-ratio), each at least 1."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low, high = int(np.floor(length * (1 - range_ratio))), int(np.ceil(length * (1 + range_ratio)))
    return np.maximum(rng.integers(low, high + 1, size=n), 1)


def random_text(counter: TokenCounter, num_tokens: int, rng: np.random.Generator) -> tuple[str, int]:
    """Text of random common words cut to ``num_tokens`` tokens; returns (text, its token count)."""
    ids: list[int] = []
    while len(ids) < num_tokens:
        words = rng.choice(WORDS, size=max(8, num_tokens - len(ids)))
        ids += counter.encode(" " + " ".join(words))
    text = counter.decode(ids[:num_tokens])
    return text, len(counter.encode(text))


def random_dataset(counter: TokenCounter, num_prompts: int, input_len: int, output_len: int,
                   range_ratio: float, rng: np.random.Generator) -> list[SampleRequest]:
    """vLLM's `random` workload: input and output lengths uniform on [L(1−r), L(1+r)]."""
    input_lens = sampled_lengths(input_len, range_ratio, num_prompts, rng)
    output_lens = sampled_lengths(output_len, range_ratio, num_prompts, rng)
    out = []
    for n_in, n_out in zip(input_lens, output_lens):
        text, count = random_text(counter, int(n_in), rng)
        out.append(SampleRequest(text, count, int(n_out)))
    return out


def prefix_repetition_dataset(counter: TokenCounter, num_prompts: int, prefix_len: int, suffix_len: int,
                              num_prefixes: int, output_len: int, rng: np.random.Generator) -> list[SampleRequest]:
    """vLLM's `prefix-repetition`: ``num_prefixes`` shared prefixes, each followed by distinct random suffixes."""
    if num_prefixes < 1 or num_prompts % num_prefixes:
        raise ValueError("--num-prompts must be a positive multiple of --prefix-repetition-num-prefixes")
    out = []
    for _ in range(num_prefixes):
        prefix, _ = random_text(counter, prefix_len, rng)
        for _ in range(num_prompts // num_prefixes):
            suffix, _ = random_text(counter, suffix_len, rng)
            prompt = f"{prefix} {suffix}"
            out.append(SampleRequest(prompt, len(counter.encode(prompt)), output_len))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def sharegpt_dataset(path: str, counter: TokenCounter, num_prompts: int, rng: np.random.Generator,
                     output_len: int | None = None) -> list[SampleRequest]:
    """vLLM's ShareGPT sampling: first human turn as prompt, reply length as output length, pruned like vLLM."""
    entries = [e for e in json.loads(Path(path).read_text()) if len(e.get("conversations", [])) >= 2]
    out: list[SampleRequest] = []
    for index in rng.permutation(len(entries)):
        if len(out) == num_prompts:
            break
        turns = entries[index]["conversations"]
        prompt, completion = turns[0]["value"], turns[1]["value"]
        prompt_len = len(counter.encode(prompt))
        reply_len = output_len or len(counter.encode(completion))
        if output_len is None and not _valid_sharegpt(prompt_len, reply_len):
            continue
        out.append(SampleRequest(prompt, prompt_len, reply_len))
    return out


def _valid_sharegpt(prompt_len: int, output_len: int) -> bool:
    """vLLM's pruning: both ≥ 4 tokens, prompt ≤ 1024, prompt + output ≤ 2048."""
    return prompt_len >= 4 and output_len >= 4 and prompt_len <= 1024 and prompt_len + output_len <= 2048


def custom_dataset(path: str, counter: TokenCounter, num_prompts: int, default_output_len: int,
                   rng: np.random.Generator, shuffle: bool = False) -> list[SampleRequest]:
    """JSONL lines of {"prompt": str, "output_tokens": int} (output_tokens optional)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if shuffle:
        rows = [rows[i] for i in rng.permutation(len(rows))]
    out = []
    for row in rows[:num_prompts]:
        if "prompt" not in row:
            raise ValueError(f"{path}: every line needs a 'prompt' field")
        n_out = int(row.get("output_tokens", default_output_len))
        out.append(SampleRequest(row["prompt"], len(counter.encode(row["prompt"])), n_out))
    return out
