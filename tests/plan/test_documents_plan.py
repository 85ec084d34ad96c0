"""Document-aware planning: ``terapipe plan --data CORPUS`` prices each tile's attention by the
context it is expected to attend under block-causal masking (`plan.documents`), from the corpus's document lengths;
with short documents the later slices cost less, the chosen slicing changes and the step is predicted shorter."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import ROOT, assert_one_line_error, run_cli

from terapipe_cli.corpus.formats import MegatronWriter
from terapipe_cli.plan.costmodel import CostModel, read_profile
from terapipe_cli.plan.documents import AttendedContext

PROFILE = ROOT / "configs" / "profiles" / "example-tiny-cpu.json"  # the tiny model, L = 1024


def write_corpus(prefix, lengths, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 256, size=int(np.sum(lengths))).astype(np.uint16)
    with MegatronWriter(prefix, np.dtype(np.uint16)) as writer:
        writer.write(ids, np.asarray(lengths))
        writer.commit()


def test_the_expected_attended_context_matches_sampled_windows():
    """E[max over b sequences of min(age, j)] against windows drawn at random offsets of the corpus itself."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, size=3000)
    attended = AttendedContext.of_lengths(lengths, 512)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    for b, j in ((1, 64), (1, 300), (4, 64), (4, 300)):
        places = rng.integers(0, lengths.sum() - 512, size=(20000, b)) + j
        ages = np.minimum(places - starts[np.searchsorted(starts, places, side="right") - 1], j)
        assert attended(b, j) == pytest.approx(ages.max(axis=1).mean(), rel=0.02)
    assert attended(1, 0) == 0 and attended(2, 300) > attended(1, 300)
    # Documents far longer than the window: the whole prefix, as full causal attention prices it.
    whole = AttendedContext.of_lengths(np.array([10**7]), 512)
    assert whole(3, np.array([100, 512])) == pytest.approx([100, 512], rel=1e-3)


def test_the_cost_model_prices_the_attended_context():
    from dataclasses import replace

    profile = read_profile(PROFILE)
    attended = AttendedContext.of_lengths(np.full(100, 64), 1024)
    full, docs = CostModel(profile, 2), CostModel(replace(profile, attended=attended), 2)
    assert docs(1, 128, 0) == pytest.approx(full(1, 128, 0))  # no context: nothing to save
    assert docs(1, 128, 896) < full(1, 128, 896)
    assert docs(1, 128, 896) == pytest.approx(full(1, 128, attended(1, 896)))


def test_plan_with_short_documents_predicts_a_shorter_step(tmp_path, capsys):
    """Documents of mean L/4 (16-496 tokens): the plan made with --data predicts a step >= 10% shorter, cuts the
    sequence differently, says so, and its simulated step agrees with its prediction as the plain plan's does."""
    write_corpus(tmp_path / "short", np.random.default_rng(1).integers(16, 497, size=2000))
    plans = {}
    for name, extra in (("full", ()), ("docs", ("--data", tmp_path / "short"))):
        out = tmp_path / f"{name}.json"
        p = run_cli(capsys, "plan", "--profile", PROFILE, "-k", "2", "-b", "1", "--out", out, "-q", *extra)
        assert p.returncode == 0, p.stderr
        plans[name] = json.loads(out.read_text())
    full, docs = plans["full"], plans["docs"]
    assert docs["predicted_s"] <= 0.9 * full["predicted_s"]
    assert docs["slices"] != full["slices"]
    assert full["attention"] == {"context": "prefix"}
    assert docs["attention"]["context"] == "documents" and docs["attention"]["documents"] == 2000
    assert "priced by the context each tile attends" in p.stdout
    for plan in (full, docs):
        assert plan["simulated_s"] == pytest.approx(plan["predicted_s"], rel=0.05)


def test_plan_data_must_record_its_documents(tmp_path, capsys):
    (tmp_path / "text.txt").write_text("no documents here")
    p = run_cli(
        capsys, "plan", "--profile", PROFILE, "-k", "2", "-b", "1", "--out", tmp_path / "p.json",
        "--data", tmp_path / "text.txt",
    )  # fmt: skip
    assert_one_line_error(p, "--data", "records no documents")
