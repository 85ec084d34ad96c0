"""Packed documents (docs/design.md §6): block-causal attention across token slices, positions
restarting at each document, the K/V cache read from the earliest document start only — for GPT and Llama, on the
CPU's branch and on the CUDA branch forced on the CPU — and ``--verify`` with the document mask, with its negative
control."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch
from conftest import local_setup, tiny_model, train_locally, verify_local_run, verify_locally

from terapipe_cli.config.controls import Controls
from terapipe_cli.corpus.formats import Documents
from terapipe_cli.engine.data import (
    TokenData,
    eos_document_starts,
    load_data,
    resolve_document_mask,
    step_batch,
    step_documents,
)
from terapipe_cli.engine.stage import StageRunner
from terapipe_cli.models import LlamaConfig, ModelConfig, build_model
from terapipe_cli.models.attention import DocumentMask, forced_branch


def _llama(layers: int = 2) -> ModelConfig:
    return LlamaConfig(
        name="test-llama", layers=layers, hidden=32, heads=4, kv_heads=2, vocab=256, seq_len=64,
        ffn_hidden=64,
    )  # fmt: skip


ARCHS = {"gpt": lambda: tiny_model(layers=2), "llama": _llama}
# Two sequences with documents starting at different places (0 and 13, 20 in row 0; 0, 5, 31 in row 1).
STARTS = [[0, 13, 20], [0, 5, 31]]


def _doc_starts(length: int) -> torch.Tensor:
    rows = []
    for starts in STARTS:
        row = np.zeros(length, np.int64)
        for s in starts:
            row[s:] = s
        rows.append(row)
    return torch.from_numpy(np.stack(rows))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_packed_documents_are_independent(arch):
    """The whole sequence with its documents masked computes, for each document, what the model computes on that
    document alone (positions from 0): the reference of ``--verify`` is right."""
    cfg = ARCHS[arch]()
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    docs = _doc_starts(40)
    with torch.no_grad():
        packed = model(tokens, docs=DocumentMask.of(docs, 0))
        for row, starts in enumerate(STARTS):
            for a, b in zip(starts, [*starts[1:], 40], strict=True):
                alone = model(tokens[row : row + 1, a:b])
                torch.testing.assert_close(packed[row : row + 1, a:b], alone, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(packed, model(tokens), atol=1e-3)  # the mask changes something


def test_a_tile_reads_the_cache_from_its_earliest_document_start():
    docs = _doc_starts(40)
    tile = DocumentMask.of(docs[:, 24:32], 24)
    assert tile.lo == 5  # row 1's document from 5 still runs at 24; row 0's began at 20
    assert tile.mask.shape == (2, 1, 8, 32 - 5)
    own = DocumentMask.of(docs[:1, 20:30], 20)
    assert own.lo == 20 and own.mask is None  # its first token starts a document: no cache rows, plain causal
    assert DocumentMask.of(docs[:1, 24:30], 24).mask is None  # one document over every row it reads: causal from 20
    assert tile.positions[1].tolist() == [*range(19, 26), 0]  # a document starts at 31


def _sliced(cfg: ModelConfig, cuts: list[int], branch: str | None, precision: str = "fp32", controls=None):
    """The loss and gradients of the model run in token slices ``cuts`` through a StageRunner, documents masked
    (``controls``: its test-only switches)."""
    runner = StageRunner(cfg, 0, 1, seed=0, precision=precision, controls=controls)
    tokens = torch.randint(0, 256, (2, 41), generator=torch.Generator().manual_seed(2))
    docs = _doc_starts(40)
    runner.set_loss_scale(1.0)
    with forced_branch(branch) if branch else contextlib.nullcontext(), runner.step():
        start, loss = 0, 0.0
        for n, i in enumerate(cuts):
            x, y = tokens[:, start : start + i], tokens[:, start + 1 : start + i + 1]
            loss += runner.forward_tile(0, n, x, y, doc_starts=docs[:, start : start + i]).item()
            start += i
        for n in reversed(range(len(cuts))):
            runner.backward_tile(0, n, None)
    return loss, {name: p.grad.clone() for name, p in runner.module.named_parameters()}


def unmasked(setup):
    """``setup`` with the test-only switch that drops the document mask over the K/V cache (the pipelined run only:
    the reference and spread runs run the whole sequence, or no switch)."""
    return type(setup)(setup.plan, dataclasses.replace(setup.args, controls=Controls(cache_masked=False).record()))


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("branch", [None, "cuda"])
def test_token_slices_across_documents_equal_the_whole_sequence(arch, branch):
    """Slices that cut documents (at 8, 17, 29: inside every document of both rows) give the loss and gradients of
    the whole sequence, on the CPU's branch and on the CUDA branch forced on the CPU; dropping the mask over the
    cache only (the negative control) does not."""
    cfg = ARCHS[arch]()
    whole_loss, whole = _sliced(cfg, [40], branch)
    loss, grads = _sliced(cfg, [8, 9, 12, 11], branch)
    assert loss == pytest.approx(whole_loss, rel=1e-5)
    for name, g in whole.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6)
    _, bad = _sliced(cfg, [8, 9, 12, 11], branch, controls=Controls(cache_masked=False))
    assert max(((bad[name] - g).norm() / g.norm()).item() for name, g in whole.items()) > 0.1  # measured: 0.76-0.94


def test_document_starts_from_the_index_and_from_eos():
    tokens = np.arange(100, dtype=np.uint16) % 7
    lengths = np.array([10, 25, 5, 60], np.int32)
    documents = Documents(lengths, np.arange(5, dtype=np.int64))
    data = TokenData("corpus", "tokens", tokens, 6, "megatron", "Megatron", documents)
    docs = step_documents(data, seed=0, step=1, sequences=3, seq_len=16)
    assert docs.shape == step_batch(data, seed=0, step=1, sequences=3, seq_len=16)[:, :-1].shape
    offsets = np.random.default_rng([0, 1]).integers(0, 100 - 16, size=3)
    starts = np.array([0, 10, 35, 40])
    for o, row in zip(offsets, docs.tolist(), strict=True):
        expect = [max(0, int(starts[starts <= o + t].max()) - o) for t in range(16)]
        assert row == expect
    # A held-out part keeps file positions.
    part = dataclasses.replace(data, tokens=tokens[30:], start=30)
    o = np.random.default_rng([0, 2]).integers(0, 70 - 16, size=1)[0]
    row = step_documents(part, seed=0, step=2, sequences=1, seq_len=16)[0].tolist()
    assert row == [max(0, int(starts[starts <= 30 + o + t].max()) - 30 - o) for t in range(16)]
    # EOS ends its own document: the next token starts one.
    ids = torch.tensor([[5, 9, 1, 2, 9, 9, 3]])
    assert eos_document_starts(ids, 9).tolist() == [[0, 0, 2, 2, 2, 5, 6]]


def test_the_mask_is_on_by_default_where_the_corpus_records_documents():
    text = load_data(None)
    assert resolve_document_mask(text, None, None) == (False, None)
    assert resolve_document_mask(text, True, None) == (True, ord("\n"))
    assert resolve_document_mask(text, True, 3) == (True, 3)
    documents = Documents(np.array([4, 4], np.int32), np.arange(3, dtype=np.int64))
    corpus = TokenData("c", "tokens", np.zeros(8, np.uint16), 0, "megatron", "Megatron", documents)
    assert resolve_document_mask(corpus, None, None) == (True, None)
    assert resolve_document_mask(corpus, False, None) == (False, None)


# Documents end at each full stop of the embedded text (sentences of 15-50 bytes): token slices cross several.
FAMILIES = [
    ("gpt", [(1, [20, 24, 20]), (1, [20, 24, 20])], 2, "fp32"),
    ("llama", [(2, [16, 16, 32])], 3, "fp32"),
    ("gpt", [(1, [32, 32]), (1, [10, 54])], 3, "bf16"),
    ("llama", [(1, [24, 40]), (1, [24, 40])], 2, "bf16"),
]


def test_verify_with_document_mask_split_backward_tensor_parallel_and_recompute():
    """ZB-H1's split backward (I then W), T = 2 and recomputation with the document mask: the same check."""
    setup = local_setup(
        [(1, [40, 24]), (1, [10, 10, 44])], stages=2, model=_llama(4), tensor_parallel=2, document_mask=True,
        eos_id=ord("."), steps=2, plan_fields={"order": "zb1p", "recompute": [True, False]},
    )  # fmt: skip
    result, _ = verify_locally(setup)
    assert result.ok, result.to_dict()


@pytest.mark.parametrize(("arch", "slices", "stages", "precision"), FAMILIES)
def test_verify_with_document_mask(arch, slices, stages, precision):
    """``--verify`` with the document mask (the embedded text's sentences as documents: EOS = ".") equals the
    single-device model with the same mask; with the mask dropped over the pipelined run's cache only, it fails."""
    layers = 6 if stages == 3 else 4
    model = _llama(layers) if arch == "llama" else tiny_model(layers=layers)
    setup = local_setup(
        slices, stages=stages, model=model, precision=precision, document_mask=True, eos_id=ord("."), steps=2
    )
    result, _ = verify_locally(setup)
    assert result.ok, result.to_dict()
    if precision == "fp32" and arch == "gpt" or precision == "bf16" and arch == "llama":
        run = train_locally(unmasked(setup))
        bad = verify_local_run(run, setup)
        assert not bad.ok
