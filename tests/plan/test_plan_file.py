"""The plan file (schema terapipe.plan/1): the short form, building, writing and validated reading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from file_errors import assert_file_error

from terapipe_cli.errors import UserError
from terapipe_cli.files import write_json_atomic
from terapipe_cli.models import GptConfig
from terapipe_cli.plan.file import (
    PLAN_SCHEMA,
    check_slices,
    make_plan_dict,
    normalize_slices,
    read_plan,
    short_form,
    write_plan,
)

MODEL = GptConfig(name="t", layers=4, hidden=32, heads=2, vocab=256, seq_len=64)


def plan_dict(**changes) -> dict:
    kw = dict(
        model=MODEL,
        stages=2,
        batch_size=3,
        seq_len=64,
        token_step=8,
        slices=[(2, [32, 16, 16]), (1, [40, 24])],
        predicted_s=0.5,
    )
    kw.update(changes)
    return make_plan_dict(**kw)


# --- short form ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "slices, text",
    [
        ([(1, [776, 640, 632])] * 16, "[(1, [776, 640, 632])] * 16"),  # docs/design.md §2's example
        ([(4, [2048])] * 2, "[(4, [2048])] * 2"),  # GPipe, microbatch 4
        ([(8, [2048])], "[(8, [2048])]"),
        ([(2, [8, 8]), (2, [8, 8]), (1, [16])], "[(2, [8, 8])] * 2 + [(1, [16])]"),
        ([(1, [16]), (2, [8, 8]), (1, [16])], "[(1, [16])] + [(2, [8, 8])] + [(1, [16])]"),
        ([[1, [16]], [1, [16]]], "[(1, [16])] * 2"),  # JSON lists as read back from a file
    ],
)
def test_short_form(slices, text: str) -> None:
    assert short_form(slices) == text


# --- round trip ---------------------------------------------------------------------------------------


def test_make_write_read_round_trip(tmp_path: Path) -> None:
    obj = plan_dict(solver={"method": "exact"})
    path = write_plan(tmp_path / "sub" / "plan.json", obj)
    assert json.loads(path.read_text()) == obj
    plan = read_plan(path)
    assert plan.model == MODEL
    assert (plan.stages, plan.batch_size, plan.seq_len, plan.token_step) == (2, 3, 64, 8)
    assert plan.slices == [(2, [32, 16, 16]), (1, [40, 24])]
    assert plan.predicted_s == 0.5
    assert plan.data_parallel == 1
    assert plan.partition.layers == (2, 2) and plan.virtual_stages == 1 and plan.chunks == 2
    assert plan.short_form() == obj["short_form"] == "[(2, [32, 16, 16])] + [(1, [40, 24])]"
    assert plan.raw["solver"] == {"method": "exact"}  # extra fields survive
    assert obj["schema"] == PLAN_SCHEMA
    assert obj["precision"] == plan.precision == "fp32"  # hand-made plans default to fp32


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_plan_carries_its_precision(tmp_path: Path, precision: str) -> None:
    path = write_plan(tmp_path / "plan.json", plan_dict(precision=precision))
    assert json.loads(path.read_text())["precision"] == precision
    assert read_plan(path).precision == precision


def test_a_plan_from_before_precision_existed_reads_as_fp32(tmp_path: Path) -> None:
    obj = plan_dict(precision="bf16")
    del obj["precision"]
    assert read_plan(write_json_atomic(tmp_path / "old.json", obj)).precision == "fp32"


def test_normalize_accepts_json_lists_and_tuples() -> None:
    assert normalize_slices([[1, [8, 8]], (2, (16,))]) == [(1, [8, 8]), (2, [16])]


# --- bad plans ----------------------------------------------------------------------------------------


def _tamper(**changes) -> dict:
    obj = plan_dict()
    for key, value in changes.items():
        if value is ...:
            del obj[key]
        else:
            obj[key] = value
    return obj


BAD = [
    ("token slices not summing to L", _tamper(slices=[[2, [32, 16]], [1, [40, 24]]]), "sum to 48"),
    ("batch slices not summing to B", _tamper(slices=[[2, [64]], [2, [64]]]), "batch size 3"),
    ("layers not divisible by stages", _tamper(stages=3), "do not divide"),
    ("wrong schema", _tamper(schema="terapipe.profile/1"), "schema"),
    ("no schema", _tamper(schema=...), "schema"),
    ("missing slices", _tamper(slices=...), "slices"),
    ("missing stages", _tamper(stages=...), "stages"),
    ("empty slices", _tamper(slices=[]), "slices"),
    ("zero batch slice", _tamper(slices=[[0, [64]], [3, [64]]]), "batch size"),
    ("zero-length token slice", _tamper(slices=[[3, [64, 0]]]), "positive"),
    ("token slice not an int", _tamper(slices=[[3, [32.0, 32]]]), "positive integers"),
    ("entry not a pair", _tamper(slices=[[3]]), "entry 0"),
    ("stages zero", _tamper(stages=0), "stages"),
    ("batch_size a string", _tamper(batch_size="3"), "batch_size"),
    ("seq_len longer than the model", _tamper(seq_len=128, slices=[[3, [128]]]), "seq_len"),
    ("negative predicted_s", _tamper(predicted_s=-1.0), "predicted_s"),
    ("model not an object", _tamper(model="tiny"), "model"),
    ("unknown precision", _tamper(precision="fp8"), "field 'precision' must be fp32, bf16 or fp16"),
    ("precision not a string", _tamper(precision=16), "field 'precision'"),
    ("negative loss_chunk_tokens", _tamper(loss_chunk_tokens=-1), "field 'loss_chunk_tokens' must be at least 0"),
    ("loss_chunk_tokens not an integer", _tamper(loss_chunk_tokens=2.5), "'loss_chunk_tokens' must be an integer"),
]


@pytest.mark.parametrize("what, obj, word", BAD, ids=[b[0] for b in BAD])
def test_read_plan_rejects(tmp_path: Path, what: str, obj: dict, word: str) -> None:
    path = write_json_atomic(tmp_path / "plan.json", obj)
    assert_file_error(read_plan, path, word)


@pytest.mark.parametrize("what, obj, word", BAD[:3], ids=[b[0] for b in BAD[:3]])
def test_write_plan_validates_before_writing(tmp_path: Path, what: str, obj: dict, word: str) -> None:
    path = tmp_path / "plan.json"
    with pytest.raises(UserError, match=word):
        write_plan(path, obj)
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary file


@pytest.mark.parametrize("text, word", [("{", "malformed JSON"), ("[]", "JSON object"), ("", "malformed JSON")])
def test_read_plan_rejects_bad_json(tmp_path: Path, text: str, word: str) -> None:
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(UserError, match=word):
        read_plan(path)


def test_read_plan_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not found"):
        read_plan(tmp_path / "missing.json")


def test_check_slices_directly() -> None:
    check_slices([(1, [4, 4]), (2, [8])], seq_len=8, batch_size=3)
    with pytest.raises(UserError, match="batch slice 1"):
        check_slices([(1, [4, 4]), (2, [7])], seq_len=8, batch_size=3)
    with pytest.raises(UserError, match="expected the batch size 4"):
        check_slices([(1, [4, 4]), (2, [8])], seq_len=8, batch_size=4)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("fold", [False, True])
def test_short_form_is_a_python_expression_of_the_scheme(seed: int, fold: bool) -> None:
    # plan.py promises the text evaluates to the scheme itself, folded or not; random schemes with runs.
    import numpy as np

    rng = np.random.default_rng(seed)
    slices = []
    for _ in range(int(rng.integers(1, 6))):
        lengths = [int(x) for x in rng.choice([8, 16, 24], size=int(rng.integers(1, 9)))]
        lengths = lengths[: int(rng.integers(1, len(lengths) + 1))] * int(rng.integers(1, 3))
        slices += [(int(rng.integers(1, 4)), lengths)] * int(rng.integers(1, 4))
    text = short_form(slices, fold=fold)
    assert eval(text, {"__builtins__": {}}) == slices, text
    # numpy integers (what a planner might hand over) print as plain numbers
    as_numpy = [(np.int64(b), [np.int64(n) for n in lengths]) for b, lengths in slices]
    assert short_form(as_numpy, fold=fold) == text


def test_short_form_folds_runs_of_three_or_more() -> None:
    assert short_form([(1, [72, 72, 72, 64])] * 2, fold=True) == "[(1, [72]*3 + [64])] * 2"
    assert short_form([(1, [72, 72, 64, 64, 64])], fold=True) == "[(1, [72, 72] + [64]*3)]"
    assert short_form([(1, [72, 72, 72, 64])], fold=False) == "[(1, [72, 72, 72, 64])]"


def test_recomputing_stages_are_named_in_ranges():
    from terapipe_cli.plan.choice import choice_text

    assert choice_text("gpipe", (False,) * 3) == "GPipe order"
    assert choice_text("1f1b", (True,) * 3) == "1F1B order, recomputed"
    assert choice_text("gpipe", (True, False, False)) == "GPipe order, recomputed on stage 0"
    assert choice_text("gpipe", (True, True, False)) == "GPipe order, recomputed on stages 0, 1"
    forty = tuple(k < 34 or k == 39 for k in range(40))
    assert choice_text("1f1b", forty) == "1F1B order, recomputed on stages 0–33, 39"
