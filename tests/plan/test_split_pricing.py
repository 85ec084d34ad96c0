"""Pricing a split backward's I and W (docs/design.md §11b): a profile of schema /2 has them apart, an older
/1 profile is split by the architecture's analytic I : W ratio and the plan says which; the simulator prices every
tile's I and W from the profile, not by one flat share."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

from terapipe_cli.errors import UserError
from terapipe_cli.files import write_json_atomic
from terapipe_cli.models import backward_input_share
from terapipe_cli.plan.choice import choice_text, split_text
from terapipe_cli.plan.costmodel import CostModel, profile_from_dict, read_profile
from terapipe_cli.plan.simulate import cost_model_parts, simulate, uniform_parts
from terapipe_cli.schedule.schedule import Schedule

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "profiles" / "tiny-cpu-measured.json"
# The tiny measured profile as one of schema /1 (its backward timed whole), the older kind a user may still have.
RAW = {k: v for k, v in json.loads(TINY.read_text()).items() if k not in ("backward_input_s", "backward_weight_s")}
RAW["schema"] = "terapipe.profile/1"


def schema_2(input_share: float, weight_share: float) -> dict:
    """The tiny profile as a /2 one whose I and W are these shares of its backward (their sum may pass 1: the
    split's two calls may cost more than the whole backward)."""
    backward = np.asarray(RAW["backward_s"])
    return {
        **RAW,
        "schema": "terapipe.profile/2",
        "backward_input_s": (input_share * backward).tolist(),
        "backward_weight_s": (weight_share * backward).tolist(),
    }


def test_a_schema_2_profile_round_trips_and_a_missing_grid_is_one_line(tmp_path):
    obj = schema_2(0.6, 0.55)
    path = write_json_atomic(tmp_path / "p2.json", obj)
    prof = read_profile(path)
    assert prof.split_source == "measured"
    inputs, weights = prof.split_grids()
    assert inputs.tolist() == obj["backward_input_s"] and weights.tolist() == obj["backward_weight_s"]
    assert prof.backward_s.tolist() == RAW["backward_s"]  # the whole backward stays as timed
    again = read_profile(write_json_atomic(tmp_path / "again.json", json.loads(path.read_text())))
    assert np.array_equal(again.backward_input_s, prof.backward_input_s)
    for key in ("backward_input_s", "backward_weight_s"):
        missing = {k: v for k, v in obj.items() if k != key}
        with pytest.raises(UserError, match=f"^p.json: field '{key}' is missing$"):
            profile_from_dict(missing, "p.json")
    with pytest.raises(UserError, match="field 'backward_input_s' must have shape"):
        profile_from_dict({**obj, "backward_input_s": obj["backward_input_s"][:1]}, "p.json")
    with pytest.raises(
        UserError, match=r"expected 'terapipe.profile/3' \(or the older 'terapipe.profile/2' or 'terapipe"
    ):
        profile_from_dict({**obj, "schema": "terapipe.profile/4"}, "p.json")


def test_a_schema_1_profile_is_split_by_the_architectures_analytic_ratio():
    prof = profile_from_dict(RAW, "tiny-1.json")
    assert prof.backward_input_s is None and prof.split_source == "ratio"
    inputs, weights = prof.split_grids()
    b, i = np.meshgrid(prof.batch_sizes, prof.token_lengths, indexing="ij")
    share = backward_input_share(prof.model, b, i, 0)
    np.testing.assert_allclose(inputs, share * prof.backward_s, rtol=1e-12)
    np.testing.assert_allclose(inputs + weights, prof.backward_s, rtol=1e-12)
    # Not a flat half: attention's backward, all I's, grows with the tile's tokens and with its context.
    assert 0.5 < share.min() < 0.51 and share.max() > 0.65
    assert backward_input_share(prof.model, 1, 64, 512) > backward_input_share(prof.model, 1, 64, 0) + 0.05
    # On every chunk, context and ends included, I + W is the whole backward; W's products do not attend.
    parts = cost_model_parts(CostModel(prof, 2))
    tiles = np.array([1, 2, 4, 1]), np.array([8, 64, 200, 64]), np.array([0, 64, 512, 960])
    for chunk in (0, 1):
        _, backward, _, _ = parts(*tiles, chunk=chunk)
        inputs, weights = parts.split(*tiles, chunk=chunk)
        np.testing.assert_allclose(inputs + weights, backward, rtol=1e-12)
        assert np.all(inputs > 0) and np.all(weights > 0)
        np.testing.assert_allclose(parts.split(1, 64, 0, chunk=chunk)[1], parts.split(1, 64, 960, chunk=chunk)[1])
    # The embedding's backward is W's (chunk 0's input is token ids): chunk 0's I is its layers' alone.
    layers_only = cost_model_parts(CostModel(prof, 4)).split(1, 64, 0, chunk=1)[0]  # a middle chunk of one layer
    two_chunks = cost_model_parts(CostModel(prof, 2)).split(1, 64, 0, chunk=0)[0]  # two layers and the embedding
    np.testing.assert_allclose(two_chunks, 2 * layers_only)


def test_the_plan_line_says_how_i_and_w_are_priced(tmp_path, capsys):
    slices = [(2, [512, 256, 256])]
    v1, v2 = profile_from_dict(RAW, "tiny-1.json"), profile_from_dict(schema_2(0.6, 0.55), "p2.json")
    text = split_text(v1, slices)
    estimate = "an estimate by the architecture's analytic ratio (a profile of schema /1, not timed apart)"
    assert text.endswith(f"of the tiles' backward, {estimate}")
    assert split_text(v2, [(2, [1024])]) == "I 60%, W 55% of the tiles' backward, timed apart (measured)"
    # A tile's context adds to its I alone: token slices after the first have more of their backward in I.
    assert split_text(v2, slices) == "I 68%, W 44% of the tiles' backward, timed apart (measured)"
    assert choice_text("zb1p", (False, False), text) == f"ZB-H1 order ({text})"
    assert choice_text("1f1b", (False, False), text) == "1F1B order"  # a whole backward needs no split
    # The plan line of `terapipe plan` on the /1 profile: the split asked for, and said to be an estimate.
    v1_file = write_json_atomic(tmp_path / "tiny-1.json", RAW)
    asked = ("--order", "zb1p", "--virtual-stages", "1")
    p = run_cli(capsys, "plan", "--profile", v1_file, "-k", "2", "-b", "2", *asked, "--out", tmp_path / "p")
    assert p.returncode == 0, p.stderr
    line = " ".join(p.stdout.split())
    assert "ZB-H1 order (I " in line and f"{estimate})" in line
    # The order left to the planner (the side-by-side's K = 2, B = 4, where it chose ZB-H1 with two chunks per
    # device; the partition fixed, as the whole search is slower): no split order from this profile.
    pinned = ("--virtual-stages", "2", "--partition", "balanced")
    p = run_cli(capsys, "plan", "--profile", v1_file, "-k", "2", "-b", "4", *pinned, "--out", tmp_path / "auto.json")
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "auto.json").read_text())["order"] in ("gpipe", "1f1b"), p.stdout


def test_the_simulator_prices_each_tiles_i_and_w_from_the_profile():
    """The share is really used: ZB-H1's step moves with it, 1F1B's (whole backwards) does not, and every I and W
    lasts what the profile says of its tile."""
    slices = [(1, [32])] * 4
    zb, one_f = Schedule.build(slices, 2, "zb1p"), Schedule.build(slices, 2, "1f1b")
    steps = [simulate(zb, uniform_parts(1.0, 2.0, input_share=s), step_s=0.0).latency_s for s in (0.5, 0.65, 0.8)]
    assert steps[0] == pytest.approx(3 * 4 + 1) and steps[0] < steps[1] < steps[2]  # the stage waits on longer I's
    assert len({simulate(one_f, uniform_parts(1.0, 2.0, input_share=s)).latency_s for s in (0.3, 0.8)}) == 1

    zb = Schedule.build([(1, [256] * 4)] * 2, 2, "zb1p")
    one_f = Schedule.build([(1, [256] * 4)] * 2, 2, "1f1b")
    costs = [CostModel(profile_from_dict(schema_2(*shares), "p2.json"), 2) for shares in ((0.9, 0.2), (0.3, 0.8))]
    assert simulate(zb, costs[0]).latency_s != pytest.approx(simulate(zb, costs[1]).latency_s, rel=1e-3)
    assert simulate(one_f, costs[0]).latency_s == simulate(one_f, costs[1]).latency_s
    parts = cost_model_parts(costs[0])
    tiles = {(t.batch_slice, t.token_slice): t for t in zb.tiles}
    split = [e for e in simulate(zb, costs[0]).events if e.phase in "IW"]
    assert len(split) == 2 * 2 * len(tiles)
    for e in split:
        t = tiles[(e.batch_slice, e.token_slice)]
        inputs, weights = parts.split(t.batch_size, t.tokens, t.token_start, chunk=e.stage)
        assert e.end_s - e.start_s == pytest.approx(float(inputs if e.phase == "I" else weights), rel=1e-9)

    def whole_only(b, i, j, chunk=0):
        return uniform_parts(1.0, 2.0)(b, i, j, chunk)

    with pytest.raises(ValueError, match="do not price them"):
        simulate(zb, whole_only)
