"""The same plans as recorded before the planner's code moved into its packages: a dozen plans of the shipped profiles
and experiments, recorded by `terapipe plan ARGS` at the commit named in tests/data/plans_shipped_configs.json, planned
again now through the same command; their schemes, predicted and simulated times, orders and memory must be the same.

Since then the planner also chooses the partition of the layers and the virtual stages, and prices the embedding and the
head: the plans are made with those pinned to what the recording had (`--virtual-stages 1 --partition balanced`, GPipe
order where the memory limit did not choose the order and 1F1B where it did), and the published settings are priced by
their analytic profile as it was then, without its ``ends`` (a profile without them is priced as before), without
``vocab_parallel`` (the embedding and the head counted whole on every tensor rank, as before) and without the pass over
the weight gradients on every tile (`conftest.without_accumulation`)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import ROOT, run_cli, without_accumulation

from terapipe_cli.config.experiment import load_experiment
from terapipe_cli.files import write_json_atomic
from terapipe_cli.profile.analytic import experiment_profile

RECORDED = json.loads((ROOT / "tests" / "data" / "plans_shipped_configs.json").read_text())
PINNED = ["--virtual-stages", "1", "--partition", "balanced"]
# The tiny model's measured profile the plans were recorded on (schema /1), kept since the bundled one was measured
# again (schema /2, I and W timed apart).
RECORDED_ON = {"configs/profiles/tiny-cpu-measured.json": "tests/data/tiny-cpu-measured-schema1.json"}


def _args(record: dict, tmp_path) -> list[str]:
    args = [RECORDED_ON.get(a, a) for a in record["args"]]
    if "--experiment" in args and "--profile" not in args:
        exp = load_experiment(args[args.index("--experiment") + 1])
        exp = replace(exp, hardware=without_accumulation(exp.hardware))
        overrides = dict(zip(args[::2], args[1::2], strict=False))
        batch = int(overrides.get("-b", exp.batch_size // exp.data_parallel))
        obj = experiment_profile(exp, batch_size=batch, tensor_parallel=exp.tensor_parallel, token_step=exp.token_step)
        obj.pop("ends")
        obj.pop("vocab_parallel")
        args += ["--profile", str(write_json_atomic(tmp_path / "analytic-without-ends.json", obj))]
    # Where the memory-aware search chose 1F1B order it chooses it again with the order fixed (it searched both and
    # kept 1F1B); with the order free, ZB-H1 (the split backward) may now run that plan faster.
    chosen_by_memory = record["order"] == "1f1b" and "--order" not in args
    return args + PINNED + ([] if "--order" in args else ["--order", "1f1b" if chosen_by_memory else "gpipe"])


@pytest.mark.parametrize("record", RECORDED["plans"], ids=[r["name"] for r in RECORDED["plans"]])
def test_the_plan_is_the_one_recorded_before_the_move(record, tmp_path, capsys):
    out = tmp_path / "plan.json"
    p = run_cli(capsys, "plan", *_args(record, tmp_path), "--out", out, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    plan = json.loads(out.read_text())
    for key in ("short_form", "order", "recompute", "stages", "batch_size", "seq_len", "token_step", "precision",
                "data_parallel", "tensor_parallel"):  # fmt: skip
        assert plan[key] == record[key], key
    for key in ("predicted_s", "simulated_s", "t_max_s"):
        assert plan[key] == pytest.approx(record[key], rel=1e-12), key
    for name, baseline in record["baselines"].items():
        assert plan["baselines"][name]["short_form"] == baseline["short_form"]
        assert plan["baselines"][name]["predicted_s"] == pytest.approx(baseline["predicted_s"], rel=1e-12)
    if "per_stage_bytes" in record:
        assert plan["memory"]["per_stage_bytes"] == pytest.approx(record["per_stage_bytes"], rel=1e-12)
