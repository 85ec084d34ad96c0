"""Training a run's GPipe baseline (`plan.baseline`): the run's own settings (`RunConfig.of_run`) with the
baseline's plan, through `terapipe train`'s preparation and launch. Same model, data, seed, learning rate, steps
and process layout (data-parallel replicas × stages × tensor ranks, device, threads) — only the slicing differs —
so any difference in time is the slicing's, and the losses must be equal up to floating-point summation order.
`terapipe report` and `terapipe run` start it; the report library only reads runs.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from terapipe_cli.config.run import RunConfig
from terapipe_cli.engine.torchrun import polling
from terapipe_cli.errors import UserError
from terapipe_cli.files import write_json_atomic
from terapipe_cli.plan.baseline import gpipe_plan_dict
from terapipe_cli.plan.file import plan_from_dict
from terapipe_cli.train.launch import launch
from terapipe_cli.train.prepare import PreparedRun, prepare_run
from terapipe_cli.train.rundir import read_config, read_metrics
from terapipe_cli.train.worker import STEP_LINES_ENV


def check_baseline(run_dir: Path, out: Path) -> None:
    """Everything `train_baseline` would refuse, checked without writing anything (the report runs this before
    it trains, so a bad request fails at once, not after the baseline's training)."""
    with tempfile.TemporaryDirectory(prefix="terapipe-baseline-") as tmp:
        _prepare(Path(run_dir), Path(tmp) / "plan.json", Path(out), write=False)


def train_baseline(run_dir: Path, out: Path, progress: Progress | None = None) -> Path:
    """Train the GPipe baseline of the run in ``run_dir`` into ``out`` through `terapipe train`'s own preparation
    and launch; with ``progress``, the workers print no step lines and ``progress(phase, steps done, steps)`` follows
    the training instead (`following`).

    Raises UserError for what the user must change (a multi-machine run, an occupied folder) and
    `terapipe_cli.train.launch.WorkerFailed` when a worker fails.
    """
    out = Path(out)
    # The run directory's own plan.json (train rewrites it with the same content), so nothing lands outside.
    prepared = _prepare(Path(run_dir), out / "plan.json", out, write=True)
    with following(out, prepared.args.steps, progress):
        launch(prepared.launch)
    return out


Progress = Callable[[str, float, float], None]  # (phase, done, total), as `profile.timer.Progress`


@contextmanager
def following(run_dir: Path, steps: int, progress: Progress | None, phase: str = "GPipe baseline (steps)"):
    """While the body trains into ``run_dir``: the workers print no step lines (`worker.STEP_LINES_ENV`), and
    ``progress`` hears the steps done so far (the records in metrics.jsonl, `torchrun.polling`)."""
    if progress is None:
        yield
        return

    def done() -> int:
        try:
            return len(read_metrics(run_dir))
        except UserError:
            return 0  # replaced while it was read: the next look counts

    progress(phase, 0, steps)
    before = os.environ.get(STEP_LINES_ENV)
    os.environ[STEP_LINES_ENV] = "0"
    try:
        with polling(lambda: progress(phase, done(), steps)):
            yield
    finally:
        if before is None:
            os.environ.pop(STEP_LINES_ENV, None)
        else:
            os.environ[STEP_LINES_ENV] = before


def baseline_scheme(run_dir: Path) -> list:
    """The baseline's slicing (for the line that announces its training)."""
    config, _ = read_config(Path(run_dir))
    return gpipe_plan_dict(plan_from_dict(config["plan"], str(Path(run_dir) / "config.json")))["slices"]


def _prepare(run_dir: Path, plan_path: Path, out: Path, *, write: bool) -> PreparedRun:
    """`terapipe train`'s preparation of the baseline: the run's own settings with the GPipe plan (written to
    ``plan_path``)."""
    config, args = read_config(run_dir)
    if int(config.get("nnodes", 1)) > 1:
        raise UserError(
            "ran on several machines; train its GPipe baseline with `terapipe train` on the same "
            "machines and pass it with --baseline",
            where=str(run_dir),
        )
    plan = plan_from_dict(config["plan"], f"{run_dir / 'config.json'}: field 'plan'")
    write_json_atomic(plan_path, gpipe_plan_dict(plan))
    settings = RunConfig.of_run(
        args, plan=str(plan_path), out=str(out), verify=False, device=str(config.get("device", "auto"))
    )
    return prepare_run(settings, write=write, controls=args.switches)
