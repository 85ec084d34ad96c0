"""`terapipe report` on run directories built with the runtime's own writers (no training: milliseconds each).

The events of each step come from the schedule simulator with tile costs proportional to their tokens, so the
pipeline's shape is known exactly: on equal tiles with free transfers the bubble must be (K−1)/(M+K−1).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import subprocess
from pathlib import Path

import pytest
from conftest import assert_one_line_error, run_cli, tiny_model
from fake_runs import GPIPE, SEQ, TERAPIPE, assert_chrome_trace, assert_nontrivial_png, make_run

from terapipe_cli.engine.mesh import Layout
from terapipe_cli.errors import UserError
from terapipe_cli.models import ModelConfig
from terapipe_cli.plan.baseline import gpipe_plan_dict
from terapipe_cli.report.build import find_baseline, find_cost_model, write_report
from terapipe_cli.report.compare import LOSS_RTOL, bubble_formula, compare, latency_stats
from terapipe_cli.report.runs import baseline_dir, check_comparable, load_run, same_settings
from terapipe_cli.report.text import segments_line
from terapipe_cli.report.trace import TraceRun, chrome_trace
from terapipe_cli.train.rundir import timeline_path


@pytest.fixture
def pair(tmp_path):
    run = make_run(
        tmp_path / "run",
        TERAPIPE,
        plan_extra={"baselines": {"gpipe": {"slices": [[1, [SEQ]]], "predicted_s": 0.09, "microbatch": 1}}},
    )
    base = make_run(tmp_path / "run-gpipe", GPIPE, losses=[5.0 - 0.1 * s + 1e-7 for s in range(6)])
    return run, base


def test_numbers_recomputed_from_the_run_directories(pair):
    run_dir, base_dir = pair
    run, base = load_run(run_dir), load_run(base_dir)
    rep = compare(run, base, warmup=2)
    for key, d in (("run", run_dir), ("baseline", base_dir)):
        lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        lat = [x["iteration_s"] for x in lines][2:]
        got = rep[key]["latency_s"]
        assert got["median"] == pytest.approx(statistics.median(lat))
        assert got["mean"] == pytest.approx(statistics.fmean(lat))
        assert got["std"] == pytest.approx(statistics.stdev(lat))
        assert (got["min"], got["max"], got["n"]) == (min(lat), max(lat), 4)
        assert rep[key]["tokens_per_s"] == pytest.approx(SEQ / statistics.median(lat))
        assert rep[key]["losses"] == [x["loss"] for x in lines]
        assert rep[key]["peak_memory_bytes"] == max(x["memory_bytes"] for x in lines)
        assert rep[key]["compared_steps"] == [3, 6]
    # Equal tiles, free transfers: the measured bubble is exactly the formula's (K−1)/(M+K−1).
    assert rep["run"]["bubble_fraction"] == pytest.approx(bubble_formula(2, 4)) == pytest.approx(1 / 5)
    assert rep["baseline"]["bubble_fraction"] == pytest.approx(1 / 2)
    assert rep["speedup"]["median"] == pytest.approx(
        rep["baseline"]["latency_s"]["median"] / rep["run"]["latency_s"]["median"]
    )
    assert rep["speedup"]["median"] > 1.0
    med = rep["run"]["latency_s"]["median"]
    assert rep["run"]["predicted_rel_err"] == pytest.approx((0.05 - med) / med)
    assert rep["loss"]["match"] is True and rep["loss"]["max_abs_diff"] == pytest.approx(1e-7, rel=1e-3)
    # Busy per stage: the whole sequence forward (10 ms) and backward (20 ms), in four tiles.
    assert [s["busy_s"] for s in rep["run"]["stage_times"]] == pytest.approx([0.03, 0.03])
    assert [s["idle_s"] for s in rep["run"]["stage_times"]] == pytest.approx([0.03 / 4, 0.03 / 4])


def test_bubble_with_data_parallel_replicas(tmp_path):
    run = load_run(make_run(tmp_path / "dp", [(1, [8, 8, 8, 8])], replicas=2))
    rep = compare(run, run, warmup=1)
    assert rep["run"]["bubble_fraction"] == pytest.approx(bubble_formula(2, 4))
    assert rep["run"]["peak_memory_bytes_per_rank"] == [1005, 1004, 1003, 1002]


def test_latency_stats_of_one_value():
    assert latency_stats([0.5]) == {"median": 0.5, "mean": 0.5, "std": 0.0, "min": 0.5, "max": 0.5, "n": 1}


def test_losses_that_differ_are_reported(tmp_path):
    run = load_run(make_run(tmp_path / "a", TERAPIPE))
    base = load_run(make_run(tmp_path / "b", GPIPE, losses=[5.0, 4.9, 4.8, 4.75, 4.6, 4.5]))
    loss = compare(run, base, warmup=1)["loss"]
    assert loss["match"] is False
    assert loss["worst_step"] == 4 and loss["max_abs_diff"] == pytest.approx(0.05)
    assert loss["max_rel_diff"] > LOSS_RTOL


def test_report_files(pair, tmp_path):
    run_dir, base_dir = pair
    run, base = load_run(run_dir), load_run(base_dir)
    out = tmp_path / "out"
    rep = write_report(run, base, out, warmup=2)
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["schema"] == "terapipe.report/1"
    assert on_disk["run"]["latency_s"] == rep["run"]["latency_s"]
    for name in ("timeline.png", "loss.png"):
        assert_nontrivial_png(out / name)
    md = (out / "report.md").read_text()
    assert "| iteration, median |" in md and "![timeline](timeline.png)" in md
    assert_chrome_trace(json.loads((out / "trace.json").read_text()), {"TeraPipe": 2, "GPipe": 2})
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_trace_lays_steps_end_to_end():
    from terapipe_cli.schedule.timeline import Event

    events = {0: [Event(0, "F", 0, 0, 0.001, 0.002, 0, 0, 1), Event(0, "F", 0, 0, 0.001, 0.002, 0, 0, 2)]}
    trace = chrome_trace([TraceRun("X", events, [0.5, 0.25], Layout(1, 1), [(1, [4])])])
    tiles = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "forward"]
    assert [e["ts"] for e in tiles] == pytest.approx([1000.0, 501000.0])
    assert tiles[0]["dur"] == pytest.approx(1000.0)
    assert tiles[0]["args"]["tokens"] == 4


def test_gpipe_plan_from_the_plans_baseline(pair):
    run = load_run(pair[0])
    g = gpipe_plan_dict(run.plan)
    assert g["slices"] == [[1, [SEQ]]] and g["predicted_s"] == 0.09 and g["scheme"] == "gpipe"
    assert (g["stages"], g["batch_size"], g["model"]) == (2, 1, run.plan.model.to_dict())


def test_gpipe_plan_without_baselines_is_microbatch_one(tmp_path):
    run = load_run(make_run(tmp_path / "r", [(2, [16, 16]), (1, [32])]))
    assert gpipe_plan_dict(run.plan)["slices"] == [[1, [SEQ]]] * 3


def test_baseline_folder_is_the_runs_sibling(pair, tmp_path, monkeypatch):
    run = load_run(pair[0])
    assert baseline_dir(run.path) == tmp_path / "run-gpipe"
    assert baseline_dir(Path("runs/x/run/")) == Path("runs/x/run-gpipe")
    monkeypatch.chdir(run.path)
    assert baseline_dir(Path(".")) == tmp_path.resolve() / "run-gpipe"
    choice = find_baseline(run, None)
    assert choice.exists and choice.path == tmp_path / "run-gpipe"
    (choice.path / "summary.json").unlink()
    with pytest.raises(UserError, match="unfinished baseline"):
        find_baseline(run, None)


def test_not_comparable(tmp_path):
    run = load_run(make_run(tmp_path / "a", TERAPIPE))
    for name, kwargs in [
        ("seed", {"seed": 1}),
        ("steps", {"steps": 5}),
        ("model", {"model": tiny_model(seq_len=SEQ, hidden=64)}),
        ("stages", {"stages": 4}),
        ("weight_decay", {"arguments": {"weight_decay": 0.2}}),
        ("decay_embeddings", {"arguments": {"decay_embeddings": False}}),
        ("decay_steps", {"arguments": {"decay_steps": 3}}),
        ("val_fraction", {"arguments": {"val_fraction": 0.1}}),
    ]:
        other = load_run(make_run(tmp_path / name, GPIPE, **kwargs))
        with pytest.raises(UserError, match=name):
            check_comparable(run, other)


def test_the_same_settings_check_derives_from_the_run_settings():
    """Every setting a resumed run keeps (they decide the numbers) must be the baseline's too, AdamW's included;
    the schedule walked and the plan may differ (the baseline's is GPipe's)."""
    from terapipe_cli.config.run import run_fields

    kept = {name for name, doc in run_fields().items() if doc.resume == "keep"} - {"schedule"}
    assert kept | {"steps", "data_parallel", "tensor_parallel", "precision"} == set(same_settings())
    assert {"weight_decay", "beta1", "beta2", "eps", "decay_embeddings", "decay_steps"} <= set(same_settings())


def report_cli(capsys, *args: str) -> subprocess.CompletedProcess:
    return run_cli(capsys, "report", *args)


def test_cli_report_with_baseline(pair, tmp_path, capsys):
    run_dir, base_dir = pair
    p = report_cli(capsys, str(run_dir), "--baseline", str(base_dir), "--out", str(tmp_path / "rep"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "TeraPipe is" in p.stdout and "Losses match" in p.stdout
    assert (tmp_path / "rep" / "report.json").exists()


def test_cli_bad_input(pair, tmp_path, capsys):
    run_dir, base_dir = pair
    (tmp_path / "empty").mkdir()
    assert_one_line_error(report_cli(capsys, str(tmp_path / "empty")), "not a run directory", "empty")
    assert_one_line_error(report_cli(capsys, str(tmp_path / "missing")), "not found")
    other = make_run(tmp_path / "other", GPIPE, model=tiny_model(seq_len=SEQ, hidden=64))
    assert_one_line_error(report_cli(capsys, str(run_dir), "--baseline", str(other)), "different model", "other")
    lines = (base_dir / "metrics.jsonl").read_text().splitlines()
    (base_dir / "metrics.jsonl").write_text("\n".join(lines[:2] + ["{not json"] + lines[3:]) + "\n")
    assert_one_line_error(report_cli(capsys, str(run_dir), "--baseline", str(base_dir)), "metrics.jsonl", "line 3")
    (base_dir / "metrics.jsonl").write_text("\n".join(lines[:2] + lines[3:]) + "\n")
    assert_one_line_error(report_cli(capsys, str(run_dir), "--baseline", str(base_dir)), "metrics.jsonl", "step 3")
    bad = [json.loads(x) for x in lines]
    bad[1]["iteration_s"] = "fast"
    (base_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in bad))
    assert_one_line_error(report_cli(capsys, str(run_dir), "--baseline", str(base_dir)), "iteration_s")
    assert_one_line_error(report_cli(capsys, str(run_dir), "--warmup", "6"), "--warmup")
    assert not (run_dir / "report").exists()  # nothing half-written


def test_cli_losses_that_differ_exit_1(tmp_path, capsys):
    run = make_run(tmp_path / "run", TERAPIPE)
    base = make_run(tmp_path / "base", GPIPE, losses=[5.0, 4.9, 4.8, 4.75, 4.6, 4.5])
    p = report_cli(capsys, str(run), "--baseline", str(base))
    assert p.returncode == 1
    assert "DO NOT match" in p.stdout and "differ beyond fp32 tolerance" in p.stderr
    assert (run / "report" / "report.json").exists()  # the report is still written, to look at


def test_a_timeline_without_a_step_is_an_error(pair):
    run_dir, _ = pair
    path = timeline_path(run_dir, 1)
    obj = json.loads(path.read_text())
    obj["events"] = [e for e in obj["events"] if e["step"] != 4]
    path.write_text(json.dumps(obj))
    with pytest.raises(UserError, match="rank_00001.json: has no events of step 4"):
        load_run(run_dir)


def test_the_plans_profile_is_found_beside_the_run_and_checked(tmp_path, monkeypatch):
    profile = Path(__file__).resolve().parents[2] / "configs" / "profiles" / "example-tiny-cpu.json"
    prof = json.loads(profile.read_text())
    (tmp_path / "profile.json").write_text(profile.read_text())
    digest = hashlib.sha256(profile.read_bytes()).hexdigest()
    model = ModelConfig.from_dict(prof["model"], "profile")
    run = load_run(
        make_run(
            tmp_path / "run",
            [(1, [SEQ])],
            model=model,
            plan_extra={"profile": {"path": "elsewhere/profile.json", "sha256": digest}},
        )
    )
    monkeypatch.chdir(tmp_path / "run")
    cost, info = find_cost_model(run, None)
    assert cost is not None and info["used"] and info["sha256"] == digest
    (tmp_path / "profile.json").write_text(profile.read_text().replace('"example"', '"measured"', 1))
    cost, info = find_cost_model(run, None)
    assert cost is None and "changed since the plan" in info["why"]
    (tmp_path / "profile.json").unlink()
    cost, info = find_cost_model(run, None)
    assert cost is None and "not here" in info["why"]


# A run resumed under another plan, D or T (`terapipe train --resume --plan NEW`): steps 1–3 under K = 2 over 4 tiles,
# steps 4–6 under K = 4 over 2 tiles. Each plan's steps are read under that plan: its own ranks' timelines.
RESUMED_BUBBLES = [bubble_formula(2, 4), bubble_formula(4, 2)]


def test_a_run_resumed_under_another_plan_is_reported_plan_by_plan(tmp_path, capsys):
    """`terapipe report RUN` (the sibling RUN-gpipe as an earlier report left it), `--no-baseline`, `--warmup N`."""
    from fake_runs import resumed_run

    run = resumed_run(tmp_path / "run")
    make_run(tmp_path / "run-gpipe", GPIPE, stages=4)
    for flags, compared in (((), [6, 6]), (("--no-baseline", "--warmup", "1"), [5, 6])):
        p = report_cli(capsys, str(run), *flags)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "Resumed under another plan: steps 1–3 under D × K × T 1 × 2 × 1" in p.stdout
        rep = json.loads((run / "report" / "report.json").read_text())
        assert rep["run"]["compared_steps"] == compared and rep["run"]["stages"] == 4
        assert len(rep["run"]["losses"]) == 6 and (rep["loss"] is None) == ("--no-baseline" in flags)
    segments = rep["run"]["segments"]
    assert [(s["steps"], s["stages"]) for s in segments] == [([1, 3], 2), ([4, 6], 4)]
    assert [s["bubble_fraction"] for s in segments] == pytest.approx(RESUMED_BUBBLES)
    assert rep["run"]["bubble_fraction"] == pytest.approx(RESUMED_BUBBLES[1])
    names = {
        e["args"]["name"].split(" · ")[0]
        for e in json.loads((run / "report" / "trace.json").read_text())["traceEvents"]
        if e["name"] == "process_name"
    }
    assert names == {"TeraPipe steps 1–3", "TeraPipe steps 4–6"}


def test_a_run_resumed_before_segments_were_kept_is_reported(tmp_path):
    """A run folder resumed under another plan by an earlier terapipe: its timelines start after the resume (the old
    plan's were removed); the report times the steps it has and says the others' plan was not recorded."""
    run = make_run(tmp_path / "run", TERAPIPE)
    for rank in range(2):
        path = timeline_path(run, rank)
        obj = json.loads(path.read_text())
        obj["events"] = [e for e in obj["events"] if e["step"] > 2]
        path.write_text(json.dumps(obj))
    rep = compare(load_run(run), None, warmup=2)
    assert "steps 1–2 under a plan this run folder did not record" in segments_line(rep)
    assert rep["run"]["compared_steps"] == [5, 6]


def test_a_resume_keeps_each_plans_steps_up_to_the_checkpoint(tmp_path):
    """Resumed from an earlier checkpoint, the steps after it are trained again: a segment ends there at the latest,
    one that starts later is dropped; a resume under the same plan keeps the run's timelines where they are."""
    from terapipe_cli.train.rundir import close_segment, segment_dirs

    run = make_run(tmp_path / "run", TERAPIPE)
    config = json.loads((run / "config.json").read_text())
    close_segment(run, config, 4, replanned=True)
    make_run(run, GPIPE, steps=6)  # the next plan's timelines (steps 5–6 are the ones read)
    close_segment(run, config, 6, replanned=True)
    assert [(f.name, a, b) for f, a, b in segment_dirs(run)] == [
        ("steps_from_000001", 1, 4), ("steps_from_000005", 5, 6)
    ]  # fmt: skip
    make_run(run, GPIPE, steps=6)
    close_segment(run, config, 3, replanned=False)
    assert [(a, b) for _, a, b in segment_dirs(run)] == [(1, 3)] and timeline_path(run, 0).exists()
    close_segment(run, config, 2, replanned=True)
    assert [(a, b) for _, a, b in segment_dirs(run)] == [(1, 2)] and not (run / "timelines").exists()
