"""Sampler over a batch of logits with per-request parameters."""

from twophase.sample.sampler import Sampler, SamplerOutput, SamplingState

__all__ = ["Sampler", "SamplerOutput", "SamplingState"]
