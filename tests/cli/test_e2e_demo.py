"""End to end, as a fresh install is used: `terapipe run --quick` (profile -> plan -> train -> report, GPipe baseline
included) once, from an empty folder outside the repository, with only the built and installed package on the path
(no dependencies: they are this environment's). Whatever the commands need — bundled models, the default data —
must come with the package, not from the checkout.

Checks the report against the run directories it came from: latencies recomputed from metrics.jsonl, the bubble
from the timelines, the losses of both runs (which must match: the same synchronous training), the pictures and
the Chrome trace; the profile's link and all-reduce measured through torchrun; then `configs` from the installed
package, and `export` and a second `report` of the demo's run (in this process).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_cli
from fake_runs import assert_chrome_trace, assert_nontrivial_png

from terapipe_cli.config.demo import load_demo_config


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The package built and installed into a folder of its own."""
    target = tmp_path_factory.mktemp("site")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target)]
    p = subprocess.run([*pip, str(ROOT)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return target


def installed_terapipe(installed: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m terapipe_cli ARGS`` with only the installed package on the path, in ``cwd``."""
    env = {**os.environ, "PYTHONPATH": str(installed), "COLUMNS": "200", "NO_COLOR": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-m", "terapipe_cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=400
    )


@pytest.fixture(scope="module")
def demo(installed, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("elsewhere")
    started = time.perf_counter()
    p = installed_terapipe(installed, tmp, "run", "--quick", "--out", str(tmp / "runs"))
    seconds = time.perf_counter() - started
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(f.name for f in tmp.iterdir()) == ["runs"]  # it wrote nowhere else
    (root,) = list((tmp / "runs").iterdir())
    print(f"terapipe run --quick took {seconds:.0f} s")
    return root, p, tmp


def _raw_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _bubble_from_timelines(run_dir: Path, steps: list[int], stages: int) -> float:
    """Independent of the report's code: 1 − Σ busy / (K · Σ span) over the steps, from the raw timeline files."""
    events = []
    for f in sorted((run_dir / "timelines").glob("rank_*.json")):
        events += json.loads(f.read_text())["events"]
    busy = span = 0.0
    for s in steps:
        mine = [e for e in events if e["step"] == s]
        busy += sum(e["end_s"] - e["start_s"] for e in mine)
        span += max(e["end_s"] for e in mine)
    return 1 - busy / (stages * span)


def test_the_demo_ends_with_the_summary_and_the_pictures(demo):
    root, p, _ = demo
    out = p.stdout
    stages = ("1/5 profile", "2/5 plan", "3/5 train", "4/5 report", "5/5 sample")
    assert [out.index(stage) for stage in stages] == sorted(out.index(stage) for stage in stages)
    assert "training the GPipe baseline" in out
    tail = out[out.index("4/5 report") : out.index("5/5 sample")]
    assert "TeraPipe is" in tail and "Losses match" in tail
    # The trained run's sample: the rule, the command, then the prompt and the 48 bytes drawn after it.
    sample = out[out.index("5/5 sample") : out.rindex("done in")].splitlines()
    assert sample[2].startswith("Ada sees") and len("\n".join(sample[2:]).strip()) > len("Ada sees"), sample
    for name in ("timeline.png", "loss.png"):
        assert str(root / "run" / "report" / name) in out.replace("\n", "")
    for name in ("model.toml", "profile.json", "plan.json", "run/summary.json", "run-gpipe/summary.json"):
        assert (root / name).exists(), name


def test_each_stage_prints_its_whole_command(demo):
    """The printed command lines are complete (nothing cut short) and name the files the demo wrote."""
    root, p, _ = demo
    out = p.stdout.splitlines()
    rules = [n for n, x in enumerate(out) if re.match(r"\d/5 (profile|plan|train|report|sample) ", x)]
    lines = [out[n + 1] for n in rules]  # each stage's rule, then its command line
    commands = [shlex.split(x) for x in lines]
    assert all(c[0] == "terapipe" for c in commands)
    assert [c[1] for c in commands] == ["profile", "plan", "train", "report", "sample"]
    assert "…" not in "".join(lines)
    outs = [c[c.index("--out") + 1] for c in commands[:3]]
    assert outs == [str(root / "profile.json"), str(root / "plan.json"), str(root / "run")]
    assert commands[3][2] == commands[4][2] == str(root / "run")
    # The demo says where it runs: on the CPU, whatever --device auto would pick here.
    for c in (commands[0], commands[2]):
        assert c[c.index("--device") + 1] == "cpu"
    for run in ("run", "run-gpipe"):
        assert json.loads((root / run / "config.json").read_text())["device"] == "cpu"


def test_report_numbers_match_the_run_directories(demo):
    root, _, _ = demo
    report = json.loads((root / "run" / "report" / "report.json").read_text())
    assert report["schema"] == "terapipe.report/1"
    warmup = report["warmup_steps"]
    plan = json.loads((root / "plan.json").read_text())
    for key, run_dir in (("run", root / "run"), ("baseline", root / "run-gpipe")):
        part = report[key]
        assert Path(part["path"]).resolve() == run_dir.resolve()
        metrics = _raw_metrics(run_dir)
        lat = [m["iteration_s"] for m in metrics][warmup:]
        assert len(lat) == part["latency_s"]["n"] > 0
        assert part["latency_s"]["median"] == pytest.approx(statistics.median(lat))
        assert part["latency_s"]["mean"] == pytest.approx(statistics.fmean(lat))
        assert part["latency_s"]["std"] == pytest.approx(statistics.stdev(lat))
        assert (part["latency_s"]["min"], part["latency_s"]["max"]) == (min(lat), max(lat))
        assert part["tokens_per_s"] == pytest.approx(plan["seq_len"] * plan["batch_size"] / statistics.median(lat))
        steps = [m["step"] for m in metrics][warmup:]
        assert part["bubble_fraction"] == pytest.approx(_bubble_from_timelines(run_dir, steps, plan["stages"]))
        assert part["peak_memory_bytes"] == max(m["memory_bytes"] for m in metrics)
        assert part["losses"] == [m["loss"] for m in metrics]
    assert report["run"]["slices"] == plan["slices"]
    assert report["baseline"]["slices"] == plan["baselines"]["gpipe"]["slices"]
    assert report["run"]["predicted_s"] == plan["predicted_s"]
    assert report["speedup"]["median"] == pytest.approx(
        report["baseline"]["latency_s"]["median"] / report["run"]["latency_s"]["median"]
    )
    # The plan's profile is at hand, so the simulator's predicted timelines are in the report.
    assert report["cost_model"]["used"] is True
    assert report["run"]["simulated"]["latency_s"] > 0 and report["baseline"]["simulated"]["latency_s"] > 0


def test_losses_of_terapipe_and_gpipe_match(demo):
    root, _, _ = demo
    a, b = _raw_metrics(root / "run"), _raw_metrics(root / "run-gpipe")
    assert len(a) == len(b) > 1
    rel = max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(a, b, strict=True))
    loss = json.loads((root / "run" / "report" / "report.json").read_text())["loss"]
    assert loss["match"] is True and loss["max_rel_diff"] == pytest.approx(rel)
    assert rel <= 1e-4  # fp32: only the summation order differs


def test_pictures_and_trace(demo):
    root, _, _ = demo
    rep = root / "run" / "report"
    for name in ("timeline.png", "loss.png"):
        assert_nontrivial_png(rep / name)
    assert_chrome_trace(json.loads((rep / "trace.json").read_text()), {"TeraPipe": 2, "GPipe": 2})
    assert "## Iteration latency" in (rep / "report.md").read_text()


def test_terapipe_waits_less_than_gpipe(demo):
    """The demo's point, visible in timeline.png: token slicing fills the pipeline's bubble."""
    root, _, _ = demo
    report = json.loads((root / "run" / "report" / "report.json").read_text())
    assert report["run"]["tiles"] > report["baseline"]["tiles"] == 1
    assert report["run"]["bubble_fraction"] < report["baseline"]["bubble_fraction"]


def test_the_profile_measured_the_link_and_the_allreduce_through_torchrun(demo):
    root, _, _ = demo
    profile = json.loads((root / "profile.json").read_text())
    assert profile["source"] == "measured" and "gloo" in profile["comm"]["method"]
    link = profile["data_parallel_link"]
    assert link["replicas"] == 2 and "gloo" in link["method"] and link["latency_s"] > 0 and link["bytes_per_s"] > 0


def test_the_installed_package_lists_its_configs(installed, demo):
    _, _, tmp = demo
    where = subprocess.run(
        [sys.executable, "-c", "import terapipe_cli; print(terapipe_cli.__file__)"],
        cwd=tmp, env={**os.environ, "PYTHONPATH": str(installed)}, capture_output=True, text=True,
    )  # fmt: skip
    assert Path(where.stdout.strip()).is_relative_to(installed), where.stdout + where.stderr
    p = installed_terapipe(installed, tmp, "configs")
    assert p.returncode == 0 and "tiny" in p.stdout and "paper-01-gpt3-1b" in p.stdout, p.stderr


def test_the_run_exports_its_model(demo, tmp_path, capsys):
    root, _, _ = demo
    p = run_cli(capsys, "export", root / "run", "--out", tmp_path / "model.pt")
    assert p.returncode == 0, p.stdout + p.stderr
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    quick = load_demo_config(quick=True)
    assert exported["model_config"]["name"] == quick.model.name and exported["step"] == quick.steps


def test_report_again_reuses_the_baseline(demo, tmp_path, capsys):
    root, _, _ = demo
    p = run_cli(capsys, "report", root / "run", "--out", tmp_path / "again", "--warmup", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "reusing the GPipe baseline" in p.stdout and "training the GPipe baseline" not in p.stdout
    assert json.loads((tmp_path / "again" / "report.json").read_text())["warmup_steps"] == 1
