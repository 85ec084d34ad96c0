"""A worker's side of a checkpoint (train/checkpoint.py has the files): `Saves.begin` has a background thread copy
this rank's stage to host memory and write it (torchrun's asynchronous checkpointing: the next step computes
meanwhile, its update waiting for the copy: `Saves.copied`), `Saves.finish` waits for the file, and then one
all-reduce tells every rank what every other wrote:

    one row per rank: [wrote (1), failed (-1) or not a writer (0), stage, run folder, size, SHA-256 as 4 int64]

After it the marking rank of each run folder writes the folder's manifest from its writers' rows (so the sizes and
checksums are those of the bytes written). If any rank's write failed (a full disk), every rank knows it at the
same moment: the step's folder is removed, the previous complete checkpoint stays as it was, the ranks whose write
failed raise `WriteFailed` naming the file and the cause (torchrun's launcher says it in one line), and the others
end quietly. `begin` is called at the boundary of the step it saves and `finish` at the first later boundary where
no rank's file is still being written (the worker's per-step all-reduce says so), at the next checkpoint, or when
the run ends or stops, so a write overlaps as many steps as it needs; the run never ends before its last save is
complete.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from terapipe_cli.train import checkpoint
from terapipe_cli.train.checkpoint import WORDS, FileEntry, WriteFailed

if TYPE_CHECKING:
    from terapipe_cli.config.run import RunArguments
    from terapipe_cli.engine.trainer import Trainer


class Saver(Protocol):
    """What `Saves` reads of the worker it saves for (train/worker.py's ``Worker``)."""

    run_dir: Path
    trainer: Trainer
    writes_shard: bool  # whether this rank writes its stage's file
    marks_stages: list[int] | None  # the stages whose files this rank marks complete in its folder (one rank each)
    folder: int  # the run folder this rank writes into

    @property
    def args(self) -> RunArguments: ...

    @property
    def rank(self) -> int: ...


COLUMNS = 3 + WORDS  # wrote, stage, folder, then the file's entry
# Stages whose state (weights and optimizer) is smaller on every rank are saved synchronously: their checkpoint is
# complete at the boundary of the step it saves, where a background write completes only after the next step. A
# stage file this small writes in a few tiny-model steps' worth of time (docs/results.md, "The step that checkpoints").
ASYNC_MIN_BYTES = 4 * 2**20
SYNC_ENV = "TERAPIPE_SYNC_CHECKPOINTS"  # "1": every checkpoint synchronous (scripts/bench_train.py --checkpoints)


class SaveFailed(Exception):
    """Another rank's checkpoint write failed: this rank ends quietly (that rank names the cause)."""


class Saves:
    """This rank's checkpoints: at most one being written."""

    def __init__(self, w: Saver, *, on_begin: Callable[[], None] = lambda: None, fault: Callable[[int], bool]):
        self.w = w
        self.on_begin = on_begin  # what else a checkpoint writes (this rank's timeline), synchronously
        self.fault = fault  # test-only: whether this rank's write of a step fails as on a full disk
        self.writer = checkpoint.StageWriter()
        self.pending: int | None = None  # the step whose files are being written
        self.saved: int | None = None  # the last step marked complete by this launch

    @property
    def writing(self) -> bool:
        """Whether this rank's file of the pending checkpoint is still being written."""
        return self.writer.running

    def begin(self, step: int) -> None:
        """Start the checkpoint of ``step`` (every rank takes part: the stage's state is gathered from its tensor
        ranks). Finish the one before first."""
        self.finish()
        w, t = self.w, self.w.trainer
        model, optimizer = t.full_state()
        if w.writes_shard:
            write = _full_disk if self.fault(step) else None
            origin = checkpoint.Origin(t.plan.model.to_dict(), layout_of(t))
            self.writer.start(w.run_dir, step, t.stage, t.plan.stages, model, optimizer, write=write, origin=origin)
        self.on_begin()
        self.pending = step
        largest = torch.tensor([checkpoint.state_bytes((model, optimizer))], dtype=torch.int64, device=t.device)
        t.comms.world.all_reduce(largest, op="max", what=f"the checkpoint of step {step}")
        if largest.item() < ASYNC_MIN_BYTES or os.environ.get(SYNC_ENV) == "1":
            self.finish()  # alike on every rank: small stages' checkpoints are complete at once

    def copied(self) -> None:
        """Before an update: the pending file's host copy of the state is made (`checkpoint.StageWriter.copied`)."""
        self.writer.copied()

    def finish(self) -> None:
        """Wait for the pending checkpoint's file, tell every rank, mark it complete (or give it up)."""
        if self.pending is None:
            return
        w, t, step = self.w, self.w.trainer, self.pending
        self.pending = None
        row = torch.zeros(t.comms.world.size, COLUMNS, dtype=torch.int64)
        failure = None
        if w.writes_shard:
            try:
                entry = self.writer.wait()
                row[w.rank] = torch.tensor([1, t.stage, w.folder, *entry.to_words()])
            except WriteFailed as e:
                failure = e
                row[w.rank, :3] = torch.tensor([-1, t.stage, w.folder])
        rows = row.to(t.device)
        t.comms.world.all_reduce(rows, what=f"the checkpoint of step {step}")
        rows = rows.cpu().tolist()
        failed = [r for r, x in enumerate(rows) if x[0] < 0]
        if failed:
            if w.marks_stages is not None:
                checkpoint.discard(w.run_dir, step)
            last = checkpoint.latest_complete(w.run_dir)
            kept = f"the last complete checkpoint, step {last}, is kept" if last else "no earlier checkpoint exists"
            if failure is not None:
                raise WriteFailed(f"the checkpoint of step {step} was not saved: {failure}; {kept}")
            raise SaveFailed(f"rank {failed[0]} could not write the checkpoint of step {step}")
        if w.marks_stages is not None:
            entries = {
                x[1]: FileEntry.from_words(checkpoint.stage_file(w.run_dir, step, x[1]).name, x[3:])
                for x in rows
                if x[0] == 1 and x[2] == w.folder
            }
            checkpoint.mark_complete(
                w.run_dir, step, t.plan.stages, w.marks_stages, entries, keep=w.args.keep_checkpoints
            )
        self.saved = step

    def close(self, timeout_s: float | None = None) -> None:
        """However the run ends: let a file being written finish (never a process gone mid-rename)."""
        self.writer.wait_quietly(timeout_s)


def layout_of(t) -> dict:
    """A trainer's layout as its checkpoints record it: D, K, T, virtual stages and each chunk's layers."""
    partition = t.schedule.partition or t.plan.partition
    return {
        "data_parallel": t.args.data_parallel,
        "stages": t.plan.stages,
        "tensor_parallel": t.args.tensor_parallel,
        "virtual_stages": partition.virtual,
        "layers_per_stage": list(partition.to_list()),
    }


def _full_disk(path, data: bytes) -> None:
    """Test-only (the switch ``fault=nospace:RANK:STEP``, `config.controls.Controls`): the write of a disk that is
    full."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
