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

import numpy as np
import pytest
from conftest import assert_one_line_error, terapipe, tiny_model

from terapipe_cli.config.model import ModelConfig
from terapipe_cli.config.run import RunArguments
from terapipe_cli.engine.mesh import Layout
from terapipe_cli.errors import UserError
from terapipe_cli.plan.baseline import gpipe_plan_dict
from terapipe_cli.plan.file import make_plan_dict
from terapipe_cli.plan.schedule import Schedule
from terapipe_cli.plan.simulate import simulate
from terapipe_cli.plan.timeline import write_timeline
from terapipe_cli.report.build import find_baseline, find_cost_model, write_report
from terapipe_cli.report.compare import LOSS_RTOL, bubble_formula, compare, latency_stats
from terapipe_cli.report.runs import baseline_dir, check_comparable, load_run
from terapipe_cli.report.trace import TraceRun, chrome_trace
from terapipe_cli.train.rundir import append_metrics, timeline_path, write_config, write_summary

SEQ = 32


def per_token_parts(forward_s_per_token: float):
    """Tiles cost in proportion to their tokens (backward twice the forward), transfers are free."""

    def parts(b, i, j):
        f = np.asarray(b, dtype=float) * np.asarray(i, dtype=float) * forward_s_per_token
        return f, 2 * f, np.zeros_like(f), np.zeros_like(f)

    return parts


def make_run(
    path: Path,
    slices,
    *,
    stages: int = 2,
    steps: int = 6,
    replicas: int = 1,
    tensor: int = 1,
    model=None,
    losses=None,
    iteration_s=None,
    tile_s: float = 0.01,
    seed: int = 0,
    plan_extra: dict | None = None,
):
    """A complete run directory as `terapipe train` writes it, with simulated (uniform-cost) timelines."""
    model = model or tiny_model(seq_len=SEQ)
    batch = sum(b for b, _ in slices)
    plan = make_plan_dict(
        model=model,
        stages=stages,
        batch_size=batch,
        seq_len=SEQ,
        token_step=1,
        slices=slices,
        predicted_s=0.05,
        data_parallel=replicas,
        tensor_parallel=tensor,
        **(plan_extra or {}),
    )
    args = RunArguments(
        steps=steps,
        data=None,
        seed=seed,
        lr=1e-3,
        data_parallel=replicas,
        checkpoint_every=10,
        threads=1,
        timeout_s=60.0,
        verify=False,
        tensor_parallel=tensor,
    )
    write_config(
        path,
        plan=plan,
        args=args,
        world_size=stages * replicas * tensor,
        device="cpu",
        backend="gloo",
        nnodes=1,
        versions={},
        created="2026-01-01T00:00:00+00:00",
    )
    losses = losses if losses is not None else [5.0 - 0.1 * s for s in range(steps)]
    sim = simulate(Schedule.build(slices, stages), per_token_parts(tile_s / SEQ), step_s=0.002)
    iteration_s = (
        iteration_s if iteration_s is not None else [sim.latency_s * (1.0 + 0.01 * (s % 3)) for s in range(steps)]
    )
    for s in range(steps):
        append_metrics(
            path,
            {
                "step": s + 1,
                "loss": losses[s],
                "iteration_s": iteration_s[s],
                "tokens_per_s": batch * replicas * SEQ / iteration_s[s],
                "memory_bytes": 1000 + s,
                "memory_bytes_per_rank": [1000 + s - r for r in range(stages * replicas * tensor)],
            },
        )
    write_timelines(path, sim.events, Layout(replicas, stages, tensor), steps=steps)
    write_summary(path, {"status": "complete", "steps": steps})
    return path


def write_timelines(path: Path, step_events, layout: Layout, *, steps: int) -> None:
    """Every rank's timeline file: the same simulated step, repeated for each step (a stage's tensor ranks alike)."""
    for rank in range(layout.world):
        stage, replica = layout.stage(rank), layout.replica(rank)
        events = []
        for s in range(steps):
            for e in step_events:
                if e.stage == stage:
                    events.append(
                        type(e)(
                            e.stage, e.phase, e.batch_slice, e.token_slice, e.start_s, e.end_s, rank, replica, s + 1
                        )
                    )
        write_timeline(timeline_path(path, rank), events, source="measured", rank=rank, stage=stage)


TERAPIPE = [(1, [8, 8, 8, 8])]
GPIPE = [(1, [SEQ])]


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


def assert_nontrivial_png(path: Path) -> None:
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    img = matplotlib.image.imread(path)
    assert img.shape[0] > 200 and img.shape[1] > 400, img.shape
    # Not blank: many distinct colours (boxes, hatching, text), not a flat image.
    colours = np.unique((img[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 50, len(colours)


def assert_chrome_trace(trace: dict, ranks_per_run: dict[str, int]) -> None:
    """Valid Chrome trace JSON: X events with µs times, one named process per rank of each run."""
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    for label, ranks in ranks_per_run.items():
        mine = sorted(n for n in names.values() if n.startswith(label + " · rank "))
        assert mine == [f"{label} · rank {r} (stage {r % 2}, replica {r // 2})" for r in range(ranks)], names
    assert len(names) == sum(ranks_per_run.values())
    xs = [e for e in events if e["ph"] == "X"]
    assert xs and all(e["pid"] in names and e["dur"] >= 0 and e["ts"] >= 0 for e in xs)
    assert {e["cat"] for e in xs} == {"forward", "backward", "step"}


def test_trace_lays_steps_end_to_end():
    from terapipe_cli.plan.timeline import Event

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
    ]:
        other = load_run(make_run(tmp_path / name, GPIPE, **kwargs))
        with pytest.raises(UserError, match=name):
            check_comparable(run, other)


def report_cli(*args: str) -> subprocess.CompletedProcess:
    return terapipe("report", *args, timeout=120)


def test_cli_report_with_baseline(pair, tmp_path):
    run_dir, base_dir = pair
    p = report_cli(str(run_dir), "--baseline", str(base_dir), "--out", str(tmp_path / "rep"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "TeraPipe is" in p.stdout and "Losses match" in p.stdout
    assert (tmp_path / "rep" / "report.json").exists()


def test_cli_bad_input(pair, tmp_path):
    run_dir, base_dir = pair
    (tmp_path / "empty").mkdir()
    assert_one_line_error(report_cli(str(tmp_path / "empty")), "not a run directory", "empty")
    assert_one_line_error(report_cli(str(tmp_path / "missing")), "not found")
    other = make_run(tmp_path / "other", GPIPE, model=tiny_model(seq_len=SEQ, hidden=64))
    assert_one_line_error(report_cli(str(run_dir), "--baseline", str(other)), "different model", "other")
    lines = (base_dir / "metrics.jsonl").read_text().splitlines()
    (base_dir / "metrics.jsonl").write_text("\n".join(lines[:2] + ["{not json"] + lines[3:]) + "\n")
    assert_one_line_error(report_cli(str(run_dir), "--baseline", str(base_dir)), "metrics.jsonl", "line 3")
    (base_dir / "metrics.jsonl").write_text("\n".join(lines[:2] + lines[3:]) + "\n")
    assert_one_line_error(report_cli(str(run_dir), "--baseline", str(base_dir)), "metrics.jsonl", "step 3")
    bad = [json.loads(x) for x in lines]
    bad[1]["iteration_s"] = "fast"
    (base_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in bad))
    assert_one_line_error(report_cli(str(run_dir), "--baseline", str(base_dir)), "iteration_s")
    assert_one_line_error(report_cli(str(run_dir), "--warmup", "6"), "--warmup")
    assert not (run_dir / "report").exists()  # nothing half-written


def test_cli_losses_that_differ_exit_1(tmp_path):
    run = make_run(tmp_path / "run", TERAPIPE)
    base = make_run(tmp_path / "base", GPIPE, losses=[5.0, 4.9, 4.8, 4.75, 4.6, 4.5])
    p = report_cli(str(run), "--baseline", str(base))
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
    profile = Path(__file__).resolve().parent.parent / "configs" / "profiles" / "example-tiny-cpu.json"
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
