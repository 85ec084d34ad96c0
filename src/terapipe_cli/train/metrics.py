"""Each step's metrics where people look (``--log``, `config.run.LOGS`): metrics.jsonl always (train/rundir.py; the
report reads it), and when asked RUN/metrics.csv (one row per step: a spreadsheet, pandas) and RUN/tensorboard/ (an
event file: ``tensorboard --logdir RUN/tensorboard``). Rank 0 writes them all from the same record (`MetricsLog`).

Both carry the record's numbers under the names of `SCALARS`: the CSV's columns are the record's keys (an empty cell
where a step has none, as val_loss on a step not evaluated, grad_norm on a step fp16 skipped), TensorBoard's tags
group them (loss/train and loss/val on one chart). A resumed run goes on from its checkpoint in both: the CSV is
written again from metrics.jsonl (already cut back to the checkpoint, `rundir.keep_metrics_until`), and TensorBoard
hides the events of the steps run again (``SummaryWriter(purge_step=...)``).
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from terapipe_cli.config.run import resolve_logs
from terapipe_cli.files import write_text_atomic
from terapipe_cli.train.rundir import append_metrics, read_metrics

# metrics.jsonl's key -> TensorBoard's tag; the CSV's columns are "step" and these keys.
SCALARS = {
    "loss": "loss/train",
    "val_loss": "loss/val",
    "lr": "lr",
    "grad_norm": "grad_norm",
    "tokens_per_s": "tokens_per_s",
    "iteration_s": "step_time_s",
    "memory_bytes": "memory_bytes",
}
CSV_FILE = "metrics.csv"
TENSORBOARD_DIR = "tensorboard"
COLUMNS = ("step", *SCALARS)


class MetricsLog:
    """Rank 0's metrics of a run in ``run_dir``, into every place ``logs`` names (`config.run.resolve_logs`); the
    first step this launch trains is ``first_step`` (after a checkpoint when resumed)."""

    def __init__(self, run_dir: Path, logs: list[str] | None, *, first_step: int = 1) -> None:
        logs = resolve_logs(logs)
        self.run_dir = Path(run_dir)
        self.csv = self.run_dir / CSV_FILE if "csv" in logs else None
        if self.csv is not None:
            write_text_atomic(self.csv, csv_text(read_metrics(self.run_dir), header=True))
        self.tensorboard = None
        if "tensorboard" in logs:
            from torch.utils.tensorboard import SummaryWriter  # the optional extra, checked before the launch

            purge = first_step if first_step > 1 else None
            self.tensorboard = SummaryWriter(str(self.run_dir / TENSORBOARD_DIR), purge_step=purge)

    def write(self, record: dict) -> None:
        """One step's record, everywhere; flushed, so a run that ends any way keeps every step it logged."""
        append_metrics(self.run_dir, record)
        if self.csv is not None:
            with open(self.csv, "a") as f:
                f.write(csv_text([record]))
        if self.tensorboard is not None:
            for key, tag in SCALARS.items():
                if record.get(key) is not None:
                    self.tensorboard.add_scalar(tag, record[key], global_step=record["step"])
            self.tensorboard.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


def csv_text(records: list[dict], *, header: bool = False) -> str:
    """Rows of the CSV for ``records`` (numbers as Python writes them, so they read back exactly)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    if header:
        writer.writerow(COLUMNS)
    for record in records:
        writer.writerow(["" if record.get(key) is None else repr(record[key]) for key in COLUMNS])
    return out.getvalue()
