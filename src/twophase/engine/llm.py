"""Offline API: ``LLM(model=...).generate(prompts, SamplingParams)``, ``.chat(...)`` and ``.stream(...)``."""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

from twophase.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from twophase.engine.llm_engine import LLMEngine
from twophase.outputs import RequestOutput
from twophase.sampling_params import SamplingParams

Prompt = str | list[int]
Messages = list[dict]


class LLM:
    """A model in-process. Extra keyword arguments set CacheConfig / SchedulerConfig / ParallelConfig fields by
    name (e.g. ``tensor_parallel_size=3``)."""

    def __init__(self, model: str, dtype: str = "auto", device: str = "cpu", seed: int = 0, progress: bool = True, **kwargs) -> None:
        cache = _pick(CacheConfig, kwargs)
        scheduler = _pick(SchedulerConfig, kwargs)
        parallel = _pick(ParallelConfig, kwargs)
        engine_options = {k: kwargs.pop(k) for k in list(kwargs) if k in _ENGINE_OPTIONS}
        if kwargs:
            raise TypeError(f"unknown LLM options: {sorted(kwargs)}")
        config = EngineConfig(
            model=model, dtype=dtype, device=device, seed=seed, cache=cache, scheduler=scheduler, parallel=parallel,
            **engine_options,
        )
        self.engine = LLMEngine(config, progress=progress)
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_engine_config(cls, config: EngineConfig, progress: bool = True) -> "LLM":
        """An LLM from a full EngineConfig (the CLI's path)."""
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config, progress=progress)
        llm.tokenizer = llm.engine.tokenizer
        return llm

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run every prompt to completion together (continuous batching); outputs in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        ids = self._add_all(prompt_list, params_list)
        finals: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finals[output.request_id] = output
        return [finals[i] for i in ids]

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.render_chat(c, chat_template) for c in conversations]
        return self.generate(prompts, sampling_params)

    def render_chat(self, messages: Messages, chat_template: str | None = None) -> list[int]:
        """Token ids of a conversation rendered by the chat template (with the generation prompt)."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, chat_template=chat_template)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield one output per step for a single request, ending with the finished one."""
        request = self.engine.add_request(prompt, sampling_params)
        try:
            while True:
                for output in self.engine.step():
                    if output.request_id == request.request_id:
                        yield output
                        if output.finished:
                            return
        finally:
            if not request.finished:
                self.engine.abort_request(request.request_id)

    def _add_all(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[str]:
        for p in params:
            p.validate()
        token_lists = [self.engine.tokenize_prompt(p) for p in prompts]  # all validated before any is queued
        return [self.engine.add_request(ids, sp).request_id for ids, sp in zip(token_lists, params)]


# EngineConfig's own scalar options (the sub-configs are filled from the remaining keyword arguments)
_ENGINE_OPTIONS = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "dtype", "device", "seed", "cache", "scheduler", "parallel"}


def _pick(cls, kwargs: dict):
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return prompts


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [dataclasses.replace(params) for _ in range(n)]
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params
