"""twophase: an LLM inference engine that measures prefill and decode apart."""

from twophase.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["LLM", "SamplingParams", "InvalidRequestError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # imported lazily so `import twophase` stays light (no torch)
        from twophase.engine.llm import LLM

        return LLM
    raise AttributeError(name)
