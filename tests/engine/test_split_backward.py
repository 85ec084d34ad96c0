"""The split backward (engine/split_backward.py, `StageRunner.backward_input` / `backward_weight`): I then W of every
tile gives the whole backward's gradients — the input's, the K/V hand-back's and the weights' — for both
architectures, in fp32 and bf16, recomputed or not; W nothing but the weights (the chunked head's weight gradient is
I's, engine/loss.py)."""

import pytest
import torch
from conftest import tiny_model

from terapipe_cli.engine.stage import StageRunner
from terapipe_cli.models import LlamaConfig, ModelConfig


def llama(layers: int = 4) -> ModelConfig:
    return LlamaConfig(name="test-llama", layers=layers, hidden=32, heads=4, vocab=256, seq_len=32)


def run(cfg, stage, stages, slices, *, split, weights_late=True, **kwargs):
    """Forward every token slice of one batch slice, then back in reverse token order: B, or I of every tile and
    then (``weights_late``) every W. Returns the input gradients and the weights' gradients."""
    torch.manual_seed(1)
    runner = StageRunner(cfg, stage, stages, seed=3, **kwargs)
    gen = torch.Generator().manual_seed(0)
    last = stage == stages - 1
    xs, grads_out, targets = [], [], []
    for n in slices:
        if stage == 0:
            xs.append(torch.randint(0, cfg.vocab, (2, n), generator=gen))
        else:
            xs.append(torch.randn(2, n, cfg.hidden, generator=gen))
        grads_out.append(None if last else torch.randn(2, n, cfg.hidden, generator=gen))
        targets.append(torch.randint(0, cfg.vocab, (2, n), generator=gen) if last else None)
    runner.set_loss_scale(0.01)
    grads_in = []
    with runner.step():
        for m, x in enumerate(xs):
            runner.forward_tile(0, m, x, targets[m])
        for m in reversed(range(len(xs))):
            if split:
                grads_in.append(runner.backward_input(0, m, grads_out[m]))
                if not weights_late:
                    runner.backward_weight(0, m)
            else:
                grads_in.append(runner.backward_tile(0, m, grads_out[m]))
        if split and weights_late:
            before = {n for n, p in runner.module.named_parameters() if p.grad is not None}
            # The chunked head's weight gradient is I's (engine/loss.py): no other weight's.
            assert before == ({"lm_head.weight"} if last else set()), "I computed weight gradients"
            for m in range(len(xs)):
                runner.backward_weight(0, m)
    assert runner.pending_tiles == 0 and runner.saved.alive == 0
    weights = {n: p.grad.clone() for n, p in runner.module.named_parameters() if p.grad is not None}
    return grads_in, weights


CASES = {
    "gpt, first of 2": (tiny_model(seq_len=32), 0, 2, {}),
    "gpt, last of 2": (tiny_model(seq_len=32), 1, 2, {}),
    "gpt, middle of 3, recomputed": (tiny_model(layers=3, seq_len=32), 1, 3, {"recompute": True}),
    "gpt, one stage, bf16": (tiny_model(seq_len=32), 0, 1, {"precision": "bf16"}),
    "llama, first of 2, recomputed": (llama(), 0, 2, {"recompute": True}),
    "llama, last of 2, bf16, the head in chunks of 5 tokens": (
        llama(),
        1,
        2,
        {"precision": "bf16", "loss_chunk_tokens": 5},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_i_then_w_is_the_whole_backward(name):
    cfg, stage, stages, kwargs = CASES[name]
    slices = [13, 8, 11]
    whole_in, whole_w = run(cfg, stage, stages, slices, split=False, **kwargs)
    split_in, split_w = run(cfg, stage, stages, slices, split=True, **kwargs)
    mixed_in, mixed_w = run(cfg, stage, stages, slices, split=True, weights_late=False, **kwargs)
    tol = 2e-2 if kwargs.get("precision") == "bf16" else 1e-5
    for a, b, c in zip(whole_in, split_in, mixed_in, strict=True):
        if a is None:
            assert b is None and c is None
        else:
            torch.testing.assert_close(b, a, rtol=tol, atol=tol * 1e-2)
            torch.testing.assert_close(c, a, rtol=tol, atol=tol * 1e-2)
    assert set(split_w) == set(whole_w) == set(mixed_w)
    for n, g in whole_w.items():
        torch.testing.assert_close(split_w[n], g, rtol=tol, atol=tol * 1e-2, msg=n)
        torch.testing.assert_close(mixed_w[n], g, rtol=tol, atol=tol * 1e-2, msg=n)


def test_w_before_its_i_is_refused():
    cfg = tiny_model(layers=2, seq_len=32)
    r = StageRunner(cfg, 0, 2)
    r.forward_tile(0, 0, torch.randint(0, 256, (1, 4)))
    with pytest.raises(RuntimeError, match="W must follow"):
        r.backward_weight(0, 0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_i_leaves_the_weights_matmuls_to_w(precision):
    """I runs no weight chain (the weights' transposes, casts, lookups): a weight consumer computes its input's
    gradient only; W runs every chain once."""
    from terapipe_cli.engine import split_backward

    cfg = tiny_model(layers=3, seq_len=32)
    runner = StageRunner(cfg, 1, 3, precision=precision)
    x = torch.randn(2, 8, cfg.hidden)
    ran: list = []
    original = split_backward.split_graph

    def watching(root, params):
        consumers, in_i = original(root, params)
        for _, _, heads in consumers:
            for node, _ in heads:
                if getattr(node, "variable", None) is None:
                    node.register_prehook(lambda grads, node=node: ran.append(node))
        assert consumers and not in_i
        return consumers, in_i

    split_backward.split_graph = watching
    try:
        with runner.step():
            runner.forward_tile(0, 0, x)
            runner.backward_input(0, 0, torch.randn(2, 8, cfg.hidden))
            assert ran == []
            runner.backward_weight(0, 0)
    finally:
        split_backward.split_graph = original
    assert len(ran) == len(set(ran)) > 0
