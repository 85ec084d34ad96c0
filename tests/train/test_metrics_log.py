"""``--log``: each step's metrics in metrics.jsonl always, and as asked in RUN/metrics.csv and in a TensorBoard event
file (train/metrics.py), read back here with the csv module and TensorBoard's own reader. In process: no workers
(the torchrun test of a diverging run checks that the workers write them)."""

from __future__ import annotations

import csv
import sys

import pytest
from conftest import assert_one_line_error, run_cli, write_plan_file

from terapipe_cli.config.run import RunConfig, load_run_config
from terapipe_cli.train.metrics import CSV_FILE, SCALARS, TENSORBOARD_DIR, MetricsLog
from terapipe_cli.train.prepare import prepare_run
from terapipe_cli.train.rundir import keep_metrics_until, read_config, read_metrics


def record(step: int, *, val: bool = False, skipped: bool = False) -> dict:
    """A step's record as a worker logs it (`worker.log_step`), with numbers that are not round in float32."""
    out = {
        "step": step, "loss": 5.0 / (step + 0.3), "lr": 3e-4 * step / 7, "grad_norm": None if skipped else 1.1 / step,
        "skipped": skipped, "iteration_s": 0.0123 * step, "tokens_per_s": 4321.987 / step,
        "memory_bytes": 300_000_000 + step, "memory_bytes_per_rank": [1, 2],
    }  # fmt: skip
    if val:
        out["val_loss"] = 5.1 / (step + 0.7)
    return out


def tensorboard_scalars(run_dir) -> dict[str, dict[int, float]]:
    """tag -> {step: value}, as TensorBoard reads the run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / TENSORBOARD_DIR))
    events.Reload()
    out = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    for tag, points in out.items():  # a step trained again after a resume shows once: the earlier one is purged
        assert len({step for step, _ in points}) == len(points), (tag, points)
    return {tag: dict(points) for tag, points in out.items()}


def same_as_jsonl(run_dir) -> None:
    """metrics.csv and TensorBoard hold exactly metrics.jsonl's numbers (TensorBoard: as float32)."""
    records = read_metrics(run_dir)
    with open(run_dir / CSV_FILE) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [r["step"] for r in records]
    scalars = tensorboard_scalars(run_dir)
    for key, tag in SCALARS.items():
        kept = {r["step"]: r[key] for r in records if r.get(key) is not None}
        assert {int(r["step"]): float(r[key]) for r in rows if r[key]} == pytest.approx(kept, rel=0, nan_ok=True)
        assert scalars.get(tag, {}) == pytest.approx(kept, rel=1e-6, nan_ok=True), tag


def test_csv_and_tensorboard_hold_the_jsonl_numbers_and_a_resume_goes_on_from_its_checkpoint(tmp_path):
    log = MetricsLog(tmp_path, ["tensorboard,csv"])
    for step in (1, 2, 3, 4):
        log.write(record(step, val=step % 2 == 0, skipped=step == 3))
    log.close()
    same_as_jsonl(tmp_path)
    assert set(tensorboard_scalars(tmp_path)) == set(SCALARS.values())
    # Resumed from step 2's checkpoint: steps 3 and 4 are trained again, with other numbers.
    keep_metrics_until(tmp_path, 2)
    log = MetricsLog(tmp_path, ["csv", "tensorboard"], first_step=3)
    for step in (3, 4, 5):
        log.write({**record(step), "loss": 4.0 + step / 9})
    log.close()
    same_as_jsonl(tmp_path)
    assert tensorboard_scalars(tmp_path)["loss/train"][4] == pytest.approx(4.0 + 4 / 9, rel=1e-6)


def test_only_jsonl_unless_asked(tmp_path):
    log = MetricsLog(tmp_path, None)
    log.write(record(1))
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    assert not (tmp_path / CSV_FILE).exists() and not (tmp_path / TENSORBOARD_DIR).exists()


@pytest.fixture
def plan(tmp_path):
    return write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2)


def test_log_is_repeatable_or_a_comma_list_and_the_run_keeps_it(tmp_path, capsys, plan):
    out = tmp_path / "run"
    p = run_cli(capsys, "train", "--plan", plan, "--log", "tensorboard,csv", "--log", "jsonl", "--dry-run")
    assert p.returncode == 0, p.stderr
    prepare_run(RunConfig(plan=str(plan), out=str(out), log=["csv", " tensorboard"], device="cpu"))
    assert read_config(out)[1].log == ["jsonl", "csv", "tensorboard"]
    assert load_run_config(out / "run.toml").log == ["jsonl", "csv", "tensorboard"]  # trains again the same way


def test_an_unknown_log_is_one_line(tmp_path, capsys, plan):
    p = run_cli(capsys, "train", "--plan", plan, "--out", tmp_path / "run", "--log", "csv,tb", "--dry-run")
    assert_one_line_error(p, "--log", "jsonl, csv, tensorboard", "'tb'")


def test_tensorboard_missing_is_one_line_naming_the_extra(tmp_path, capsys, plan, monkeypatch):
    """Without the optional package: one line saying how to install it, before anything is written."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` now raises ImportError
    out = tmp_path / "run"
    p = run_cli(capsys, "train", "--plan", plan, "--out", out, "--log", "tensorboard", "--device", "cpu")
    assert_one_line_error(p, "--log", "tensorboard", "pip install 'terapipe-cli[tensorboard]'")
    assert not out.exists()
