"""The chunked LM head and cross-entropy (engine/loss.py): a tile's head and loss run a few tokens at a time, forward
and backward, and give the unchunked computation's losses and every gradient — through the workers' own trainer
(every rank a thread, `local_world`), for both architectures, fp32 and bf16, the vocabulary split over two tensor
ranks, tied embeddings across stages, packed documents, recomputation and ZB-H1's split backward. ``--verify`` passes
with a chunk smaller than a tile, and fails when one chunk's gradient is dropped."""

from __future__ import annotations

import pytest
import torch
from conftest import local_setup, tiny_model, train_locally, verify_locally
from test_gpt2_trainer import gpt2_model
from test_llama_trainer import llama_model

from terapipe_cli.engine import loss
from terapipe_cli.engine.stage import StageRunner

CHUNK = 5  # smaller than every tile below, and no divisor of most: the last chunk of a tile is shorter
ODD_VOCAB = tiny_model(layers=4, seq_len=32, vocab=201)  # T = 2 holds rows 0-99 and 100-200

DOCUMENTS = {"document_mask": True, "eos_id": ord(".")}
# name: (slices, stages, model, run arguments, plan fields)
CASES = {
    "gpt, fp32, packed documents, recomputed": ([(2, [8, 8, 16])], 2, None, DOCUMENTS, {"recompute": [False, True]}),
    "gpt, bf16": ([(2, [8, 8, 16])], 2, None, {"precision": "bf16"}, {}),
    "llama, fp32, ZB-H1's split backward": ([(1, [8, 24])] * 3, 2, llama_model(2), {}, {"order": "zb1p"}),
    "llama, bf16, one stage": ([(2, [16, 16])], 1, llama_model(2), {"precision": "bf16"}, {}),
    "the vocabulary split over T=2, tied across stages": (
        [(1, [8, 24])] * 2,
        2,
        gpt2_model(2, tie_embeddings=True, vocab=201),
        {"tensor_parallel": 2},
        {},
    ),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("name", list(CASES))
def test_chunked_equals_unchunked_losses_and_gradients(name):
    """One step, the head in chunks of 5 tokens and whole: the same loss and every parameter's gradient, up to the
    order of additions (fp32) or the rounding of the head's 16-bit products (bf16, whose weight gradient the chunked
    head sums in fp32 where the unchunked one rounds it to 16 bits once)."""
    slices, stages, model, args, fields = CASES[name]
    runs = {}
    for chunk in (0, CHUNK):
        setup = local_setup(
            slices, stages=stages, model=model, plan_fields=fields, steps=1, loss_chunk_tokens=chunk, **args
        )
        runs[chunk] = train_locally(setup)
    whole, chunked = runs[0], runs[CHUNK]
    bf16 = args.get("precision") == "bf16"
    assert chunked.losses[0] == pytest.approx(whole.losses[0], rel=1e-3 if bf16 else 1e-6)
    assert set(chunked.grads) == set(whole.grads)
    for n, g in whole.grads.items():
        assert _rel(chunked.grads[n], g) <= (2e-2 if bf16 else 1e-5), n


def test_the_head_keeps_nothing_of_the_vocabulary_for_the_backward():
    """What the last stage keeps for a tile's backward (`SavedBytes`) no longer grows with the vocabulary: 16 times
    the rows cost the unchunked head 16 times its logits, the chunked one nothing (its logits are one chunk's, for a
    moment)."""

    def kept(vocab: int, chunk: int) -> int:
        cfg = tiny_model(layers=2, seq_len=64, vocab=vocab)
        runner = StageRunner(cfg, 1, 2, loss_chunk_tokens=chunk)
        x, targets = torch.randn(2, 64, cfg.hidden), torch.randint(0, vocab, (2, 64))
        with runner.step():
            runner.forward_tile(0, 0, x, targets)
            runner.backward_tile(0, 0, None)
        return runner.saved.take_peak()

    small, large = 256, 16 * 256
    assert kept(large, 0) - kept(small, 0) >= 2 * 64 * (large - small) * 4  # at least the fp32 logits
    assert kept(large, 16) == kept(small, 16)


VERIFIED = {
    "ZB-H1, the vocabulary split over T=2, bf16": (
        [(1, [8, 24])] * 2,
        2,
        ODD_VOCAB,
        {"tensor_parallel": 2, "precision": "bf16", "plan_fields": {"order": "zb1p"}},
    ),
}


@pytest.mark.parametrize("name", list(VERIFIED))
def test_verify_passes_with_a_chunk_smaller_than_a_tile(name):
    slices, stages, model, args = VERIFIED[name]
    result, _ = verify_locally(local_setup(slices, stages=stages, model=model, loss_chunk_tokens=CHUNK, **args))
    assert result.ok, [(c.what, c.max_rel, c.tolerance) for c in result.checks]


def test_dropping_one_blocks_gradient_fails_verification(monkeypatch):
    """Negative control: the backward's blocks of vocabulary rows after the first back-propagate nothing (neither
    their part of the input's gradient nor their rows of the head's weight gradient); the same check fails, its
    gradients by far more than their tolerance."""
    backward = loss._block_backward
    dropped = []

    def dropping(xc, local, lse, grad, wc, v0, v1, grad_x, weight):
        if v0 > 0:
            dropped.append(v0)
            return
        backward(xc, local, lse, grad, wc, v0, v1, grad_x, weight)

    monkeypatch.setattr(loss, "_block_backward", dropping)
    result, _ = verify_locally(local_setup([(2, [8, 8, 16])], stages=2, loss_chunk_tokens=CHUNK))
    assert dropped and not result.ok
    grads = next(c for c in result.checks if c.what.startswith("gradients"))
    assert grads.max_rel > 10 * grads.tolerance


def test_the_backward_takes_as_many_logits_at_a_time_as_the_forward():
    """A tile of n tokens walks the vocabulary in blocks of chunk · V / n rows: the logits made at a time are at most a
    forward chunk's, all the rows when the tile fits one chunk."""
    assert loss.vocab_block_rows(4096, 131072, 1024) == 32768
    assert loss.vocab_block_rows(512, 131072, 1024) == 131072
    assert loss.vocab_block_rows(10**6, 100, 5) == 1
