"""scripts/gpu_bringup.sh's dry run: without CUDA it runs every step's command on the CPU with the tiny models, and
what it leaves in OUTDIR fits what a lent GPU machine sends back (8 files, 2 folders deep, plain names).

One test, the whole dry run (~80 s on a shared two-core machine, about as much CPU time, most of it the processes
that start PyTorch): the GPU session that runs the script gets one try, so every command in it must have run
somewhere first (the steps that repeat another's commands with other numbers, or the suite's own, are skipped on
the CPU).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu_bringup.sh"
FILES_SENT_BACK = 8
FOLDERS_DEEP = 2
PLAIN_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def script_steps() -> list[str]:
    """The step names in the script's STEPS list, in order."""
    block = re.search(r"^STEPS=\((.*?)^\)", SCRIPT.read_text(), re.S | re.M)
    assert block, "no STEPS=( ... ) in the script"
    return re.findall(r'"([a-z0-9-]+) \d+"', block.group(1))


def table_rows(summary: str) -> list[list[str]]:
    """The cells of the summary table's step rows (``| 1 | verify-k1 | ... |``)."""
    lines = [line for line in summary.splitlines() if re.match(r"^\| \d+ \|", line)]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]


def failed_steps_output(out) -> str:
    """The end of steps.log's sections of the steps that did not end ok or skipped (for the failure message)."""
    log = (out / "steps.log").read_text() if (out / "steps.log").exists() else ""
    sections = re.split(r"(?m)^(?====== \[\d+/\d+\] )", log)
    bad = [s for s in sections if re.search(r"(?m)^===== \S+: (failed|timed out)", s)]
    return "\n".join(s[-3000:] for s in bad)


def test_the_dry_run_runs_every_step_on_the_cpu_and_fits_what_is_sent_back(tmp_path):
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    scratch.mkdir()
    # No GPU (as conftest hides it), this interpreter, scratch under tmp_path; no pytest state of this run leaks
    # into the script's own pytest step.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    # A budget and step limits (x10) no loaded machine reaches: on a slow day no step is skipped or cut for time.
    env.update(
        CUDA_VISIBLE_DEVICES="",
        PYTHON=sys.executable,
        TMPDIR=str(scratch),
        GPU_BRINGUP_BUDGET_S="900",
        GPU_BRINGUP_STEP_SCALE="10",
    )
    p = subprocess.run(["bash", str(SCRIPT), str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:] + failed_steps_output(out)

    summary = (out / "summary.md").read_text()
    assert "no CUDA" in summary
    rows = table_rows(summary)
    steps = script_steps()
    assert len(steps) == 13 and [r[1] for r in rows] == steps, summary
    for _, name, device, status, seconds, result in rows:
        assert device == "cpu (no CUDA)", (name, device)
        # ok with a result line, or skipped with its reason; never failed or timed out
        assert status == "ok" or re.match(r"^skipped: \S", status), (name, status)
        assert status != "ok" or result, (name, "no result line")
        assert float(seconds) >= 0
    results = {r[1]: r[5] for r in rows}
    statuses = {r[1]: r[3] for r in rows}
    assert results["verify-k1"].startswith("verified") and "bf16" in results["verify-k1"]
    # the same commands as another step's with other numbers: K = 2, T = 2 and v = 2 verify in tests/train and
    # tests/engine
    # and the memory step's plan, train and report run in tests/train, its line on a report in tests/report
    # and the operator step's commands run in tests/profile on a small grid
    for name in ("verify-k2-shared", "verify-k2-v2", "t2-shared", "bench-llama-long", "memory", "operators"):
        assert statuses[name].startswith("skipped: no CUDA"), (name, statuses[name])
    assert "held-out context-fit error" in results["profile"]
    assert "whole sequence" in results["bench-gpt"] and "no CUDA" in results["bench-gpt"]
    assert results["reference"].startswith("plain PyTorch: eager")
    # the cuts narrowed to H = 128 on the CPU (the name says so), at their two lengths
    assert "llama-tiny-2l-h128-L64" in results["bench-llama-short"]
    assert (
        results["memory-trace"].startswith("2 cases: estimate")
        and "2 ran, 0 estimated to fit" in results["memory-trace"]
    )
    assert re.match(r"^\d+ skipped \(no CUDA\)", results["gpu-tests"]) or rows[-1][3].startswith("skipped")

    log = (out / "steps.log").read_text()
    for n, name in enumerate(steps, 1):
        assert f"===== [{n}/{len(steps)}] {name} " in log  # each step's output under its header

    files = [f for f in out.rglob("*") if f.is_file()]
    assert 0 < len(files) <= FILES_SENT_BACK, sorted(f.name for f in files)
    for f in out.rglob("*"):
        assert len(f.relative_to(out).parts) <= FOLDERS_DEEP + 1 and PLAIN_NAME.match(f.name), f
    assert {"summary.md", "steps.log"} <= {f.name for f in files}
    assert not list(scratch.iterdir())  # the scratch folder (runs, cuts, profiles) is gone


def test_the_operator_steps_line_names_each_models_check(tmp_path):
    """The operator step's result line reads the check lines the step collects (``NAME: check: ...``, as
    `terapipe profile --check-profile` prints its error), and says so when none finished."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_bringup", ROOT / "scripts" / "gpu_bringup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = tmp_path / "checks.txt"
    path.write_text("")
    assert module.operators_line(path) == "no check finished (see steps.log)"
    path.write_text(
        "gpt3-1b-2l-L2048: check: relative error mean 6.1%, max 12.0%\n"
        "llama3-8b-2l-h3072-L32768: check: relative error mean 9.9%, max 18.5%\n"
    )
    line = module.operators_line(path)
    assert line.endswith("gpt3-1b-2l-L2048 6.1% mean, 12.0% max; llama3-8b-2l-h3072-L32768 9.9% mean, 18.5% max")
