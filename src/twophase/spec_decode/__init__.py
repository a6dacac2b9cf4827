"""Speculative decoding: proposals (ngram prompt lookup), the config, and acceptance statistics.

The mechanism lives where the work is: the scheduler gives a request with proposals 1 + k tokens in the flat
batch, the runner returns logits at all 1 + k positions, the sampler accepts (``sample/rejection.py``), and the
scheduler rolls ``num_computed_tokens`` back over the rejected positions.
"""

from twophase.spec_decode.config import SpeculativeConfig
from twophase.spec_decode.ngram import NgramProposer, can_speculate
from twophase.spec_decode.stats import SpecDecodeStats

__all__ = ["SpeculativeConfig", "NgramProposer", "SpecDecodeStats", "can_speculate"]
