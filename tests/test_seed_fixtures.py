"""The seed fixtures: a hand-computed toy network, and a small untrained transformer in float64 where one
cached decode step equals recomputing the whole sequence, and later tokens never change earlier rows."""

import torch

from twophase.config import CacheConfig, ModelConfig
from twophase.engine.model_runner import ModelRunner
from twophase.model.registry import random_weights
from twophase.outputs import ScheduledRequest, SchedulerOutput


def test_toy_network_by_hand():
    w1 = torch.tensor([[1.0, 1.0], [-1.0, 1.0]])
    w2 = torch.tensor([[2.0, 0.0], [1.0, 3.0], [-1.0, 3.0]])

    def net(x):
        pre = w1 @ x
        hidden = torch.relu(pre)
        return pre, hidden, w2 @ hidden

    pre, hidden, logits = net(torch.tensor([2.0, -1.0]))
    assert pre.tolist() == [1.0, -3.0]
    assert hidden.tolist() == [1.0, 0.0]
    assert logits.tolist() == [2.0, 1.0, -1.0]
    assert int(torch.argmax(logits)) == 0
    _, _, logits = net(torch.tensor([0.0, 1.0]))
    assert logits.tolist() == [2.0, 4.0, 2.0]
    assert int(torch.argmax(logits)) == 1


TINY = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
    max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip


def make_runner() -> ModelRunner:
    cache = CacheConfig(block_size=4, num_blocks=16)
    return ModelRunner(TINY, random_weights(TINY, seed=3, std=0.2), cache, 64, torch.float64, torch.device("cpu"))


def step(rid: str, tokens: list[int], start: int, blocks: list[int]) -> SchedulerOutput:
    return SchedulerOutput(0, [ScheduledRequest(rid, tokens, start, blocks, sample=True, is_prompt=start == 0)])


def test_cached_decode_equals_recompute_float64():
    runner = make_runner()
    tokens = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14]
    full = runner.forward_logits(step("full", tokens, 0, [0, 1, 2]))  # [11, vocab]
    runner.forward_logits(step("inc", tokens[:-1], 0, [4, 5, 6]))  # prefill 10 tokens into other blocks
    last = runner.forward_logits(step("inc", tokens[-1:], 10, [4, 5, 6]))  # one cached decode step
    torch.testing.assert_close(last[0], full[-1], rtol=1e-12, atol=1e-12)


def test_later_token_leaves_earlier_rows_unchanged():
    runner = make_runner()
    tokens = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14]
    changed = tokens[:8] + [1, 1, 1]
    a = runner.forward_logits(step("a", tokens, 0, [0, 1, 2]))
    b = runner.forward_logits(step("b", changed, 0, [4, 5, 6]))
    torch.testing.assert_close(a[:8], b[:8], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(a[8:], b[8:])


def test_packed_requests_do_not_see_each_other():
    """Same-document condition: two requests in one flat batch give the logits each gives alone."""
    runner = make_runner()
    x, y = [5, 17, 3, 88, 41, 9], [60, 2, 33, 71, 14, 8, 8, 8, 1]
    alone_x = runner.forward_logits(step("x", x, 0, [0, 1]))
    alone_y = runner.forward_logits(step("y", y, 0, [2, 3, 4]))
    packed = runner.forward_logits(
        SchedulerOutput(0, [ScheduledRequest("x", x, 0, [6, 7], True, True), ScheduledRequest("y", y, 0, [8, 9, 10], True, True)])
    )
    torch.testing.assert_close(packed[:6], alone_x, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(packed[6:], alone_y, rtol=1e-12, atol=1e-12)


def test_mixed_step_decode_rows_match_recompute():
    """A step mixing two decode tokens and a prefill chunk gives each row the logits of a full recompute."""
    runner = make_runner()
    x, y, z = [5, 17, 3, 88, 41], [60, 2, 33, 71, 14, 8, 8], [9, 9, 4]
    runner.forward_logits(step("x", x[:-1], 0, [0, 1]))
    runner.forward_logits(step("y", y[:-1], 0, [2, 3]))
    mixed = runner.forward_logits(
        SchedulerOutput(0, [
            ScheduledRequest("x", x[-1:], len(x) - 1, [0, 1], True, False),
            ScheduledRequest("y", y[-1:], len(y) - 1, [2, 3], True, False),
            ScheduledRequest("z", z, 0, [4], True, True),
        ])
    )  # fmt: skip
    full_x = runner.forward_logits(step("x2", x, 0, [8, 9]))
    full_y = runner.forward_logits(step("y2", y, 0, [10, 11]))
    full_z = runner.forward_logits(step("z2", z, 0, [12]))
    torch.testing.assert_close(mixed[0], full_x[-1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mixed[1], full_y[-1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mixed[2:], full_z, rtol=1e-12, atol=1e-12)
