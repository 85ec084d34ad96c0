"""Checkpoints that prove themselves, in one process: the manifest (every file with its size and SHA-256, written
last), a damaged or unfinished newest checkpoint passed over for the previous one (also by `terapipe train --resume`,
in one line), --keep-checkpoints, a full disk during a write, the background writer, and old markers."""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading

import pytest
import torch
from conftest import run_cli
from fake_runs import checkpointed_run

from terapipe_cli.train import checkpoint
from terapipe_cli.train.checkpoint import FileEntry, StageWriter, WriteFailed


def write_checkpoint(run, step: int, stages: int = 2, *, keep: int = checkpoint.KEEP) -> None:
    entries = {
        k: checkpoint.save_stage(run, step, k, stages, {"w": torch.full((4,), float(step + k))}, {})
        for k in range(stages)
    }
    checkpoint.mark_complete(run, step, stages, entries=entries, keep=keep)


def test_the_manifest_lists_every_file_with_its_size_and_checksum(tmp_path):
    write_checkpoint(tmp_path, 2)
    marker = json.loads((checkpoint.step_dir(tmp_path, 2) / checkpoint.MARKER).read_text())
    assert marker["schema"] == checkpoint.MARKER_SCHEMA and marker["step"] == 2
    for f in marker["files"]:
        data = (checkpoint.step_dir(tmp_path, 2) / f["name"]).read_bytes()
        assert f == FileEntry.of(f["name"], data).__dict__
    assert [f["name"] for f in marker["files"]] == ["stage_000.pt", "stage_001.pt"]
    entry = FileEntry.of("x", b"some bytes")
    assert FileEntry.from_words("x", entry.to_words()) == entry  # through an all-reduce's int64 row


def test_a_damaged_or_unfinished_newest_checkpoint_is_passed_over(tmp_path):
    for step in (2, 4):
        write_checkpoint(tmp_path, step)
    assert checkpoint.latest_verified(tmp_path) == (4, [])
    path = checkpoint.stage_file(tmp_path, 4, 1)
    size = path.stat().st_size
    data = bytearray(path.read_bytes())
    data[size // 2] ^= 0xFF  # same size, one byte changed: only the checksum sees it
    path.write_bytes(bytes(data))
    assert checkpoint.complete_steps(tmp_path) == [2, 4]  # the cheap check (sizes) passes
    assert checkpoint.latest_verified(tmp_path) == (
        2,
        ["the checkpoint of step 4 is not usable (stage_001.pt does not match its checksum)"],
    )
    path.write_bytes(bytes(data[:100]))  # truncated
    assert checkpoint.complete_steps(tmp_path) == [2]
    assert checkpoint.latest_verified(tmp_path)[1] == [
        f"the checkpoint of step 4 is not usable (stage_001.pt has 100 bytes, its manifest says {size})"
    ]
    checkpoint.save_stage(tmp_path, 6, 0, 2, {"w": torch.ones(1)}, {})  # a save cut short: no manifest
    assert checkpoint.latest_verified(tmp_path)[0] == 2
    assert "step 6 is not usable (no complete.json" in checkpoint.latest_verified(tmp_path)[1][0]
    checkpoint.stage_file(tmp_path, 2, 0).unlink()
    assert checkpoint.latest_verified(tmp_path)[0] is None


def test_keep_checkpoints_removes_older_ones_only_once_a_newer_one_is_complete(tmp_path):
    for step in (1, 2, 3):
        write_checkpoint(tmp_path, step, keep=3)
    checkpoint.save_stage(tmp_path, 4, 0, 2, {"w": torch.ones(1)}, {})  # written, not complete yet
    assert checkpoint.complete_steps(tmp_path) == [1, 2, 3]
    checkpoint.save_stage(tmp_path, 4, 1, 2, {"w": torch.ones(1)}, {})
    checkpoint.mark_complete(tmp_path, 4, 2, keep=1)
    assert checkpoint.step_folders(tmp_path) == [4]
    write_checkpoint(tmp_path, 5, keep=2)
    assert checkpoint.step_folders(tmp_path) == [4, 5]


def test_a_full_disk_fails_the_write_and_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """The disk fills part-way through a stage file: torch.save's own error ("[enforce fail at inline_container.cc]
    unexpected pos") gives way to the file's, said as "disk full" with the path; nothing of the file is left."""
    write_checkpoint(tmp_path, 2)
    real_fdopen = os.fdopen

    class FullDisk:
        def __init__(self, f):
            self.f, self.room = f, 600  # the first of torch.save's writes fit, a later one does not

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            if len(data) > self.room:
                self.f.write(bytes(data[: self.room]))
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.room -= len(data)
            return self.f.write(data)

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: FullDisk(real_fdopen(fd, mode)))
    with pytest.raises(WriteFailed) as failed:
        checkpoint.save_stage(tmp_path, 4, 1, 2, {"w": torch.ones(1000)}, {})
    monkeypatch.undo()
    path = checkpoint.stage_file(tmp_path, 4, 1)
    assert str(failed.value) == f"{path}: cannot write: disk full (No space left on device)"
    assert list(checkpoint.step_dir(tmp_path, 4).iterdir()) == []  # no temporary file left behind
    assert checkpoint.latest_verified(tmp_path) == (
        2,
        ["the checkpoint of step 4 is not usable (no complete.json (the save did not finish))"],
    )
    checkpoint.discard(tmp_path, 4)
    assert checkpoint.step_folders(tmp_path) == [2]


def test_free_disk_is_checked_before_a_checkpoint_file_is_written(tmp_path, monkeypatch):
    """Less room than the stage's state (4,000 bytes of weights, 8,000 of AdamW moments): "disk full" with the path
    and both sizes before a byte is written."""
    free = {"bytes": 11_999}
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=free["bytes"]))
    moments = {"exp_avg": torch.zeros(1000), "exp_avg_sq": torch.zeros(1000)}
    with pytest.raises(WriteFailed) as failed:
        checkpoint.save_stage(tmp_path, 4, 1, 2, {"w": torch.ones(1000)}, {"by_name": {"w": moments}})
    path = checkpoint.stage_file(tmp_path, 4, 1)
    assert str(failed.value) == f"{path}: disk full: needs about 12,000 bytes, {tmp_path} has 11,999 bytes free"
    assert not checkpoint.step_dir(tmp_path, 4).exists()
    free["bytes"] = 13_000  # the file's few hundred bytes of structure beyond its tensors are not counted
    checkpoint.save_stage(tmp_path, 4, 1, 2, {"w": torch.ones(1000)}, {"by_name": {"w": moments}})


def test_the_writer_saves_a_copy_taken_before_the_weights_change(tmp_path):
    weights = torch.zeros(1000)
    writer = StageWriter()
    writer.start(tmp_path, 1, 0, 1, {"w": weights}, {})
    writer.copied()  # as the next step does before its update
    weights += 1  # the next step's update, while the file is written
    entry = writer.wait()
    assert entry == FileEntry.of("stage_000.pt", checkpoint.stage_file(tmp_path, 1, 0).read_bytes())
    assert torch.equal(checkpoint.load_stage(tmp_path, 1, 0)["model"]["w"], torch.zeros(1000))
    writer.start(
        tmp_path,
        2,
        0,
        1,
        {"w": weights},
        {},
        write=lambda path, data: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")),
    )
    with pytest.raises(WriteFailed, match="No space left on device"):
        writer.wait()
    assert not writer.busy


def test_a_checkpoint_from_before_the_manifest_counts_when_its_files_are_there(tmp_path):
    write_checkpoint(tmp_path, 2)
    marker = checkpoint.step_dir(tmp_path, 2) / checkpoint.MARKER
    files = [f["name"] for f in json.loads(marker.read_text())["files"]]
    marker.write_text(json.dumps({"schema": checkpoint.OLD_MARKER_SCHEMA, "step": 2, "stages": 2, "files": files}))
    assert checkpoint.latest_verified(tmp_path) == (2, [])
    checkpoint.stage_file(tmp_path, 2, 1).unlink()
    assert checkpoint.complete_steps(tmp_path) == []


def test_resume_passes_over_a_truncated_checkpoint_in_one_line(tmp_path, capsys):
    run = checkpointed_run(tmp_path / "run", step=3)
    for k in range(2):  # an older checkpoint too: step 2, the same weights
        record = checkpoint.load_stage(run, 3, k)
        checkpoint.save_stage(run, 2, k, 2, record["model"], record["optimizer"])
    checkpoint.mark_complete(run, 2, 2)
    path = checkpoint.stage_file(run, 3, 1)
    path.write_bytes(path.read_bytes()[:-10])
    p = run_cli(capsys, "train", "--resume", "--out", run, "--steps", "5", "--dry-run")
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stderr.strip().splitlines() == [
        f"terapipe: the checkpoint of step 3 is not usable (stage_001.pt has {path.stat().st_size} bytes, its manifest "
        f"says {path.stat().st_size + 10}): resuming from step 2"
    ]
    assert "--resume-step 2" in p.stdout
    checkpoint.stage_file(run, 2, 0).write_bytes(b"")
    p = run_cli(capsys, "train", "--resume", "--out", run, "--steps", "5", "--dry-run")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "no complete checkpoint to resume from: the checkpoint of step 3 is not usable" in p.stderr
    assert "the checkpoint of step 2 is not usable (stage_000.pt has 0 bytes" in p.stderr


def test_a_disk_without_room_for_one_checkpoint_is_one_line_before_the_launch(tmp_path, capsys, monkeypatch):
    """`terapipe train` onto a disk with less free than one checkpoint (12 bytes a parameter): exit 2, no folder."""
    from conftest import assert_one_line_error, write_plan_file

    from terapipe_cli import files

    real = shutil.disk_usage
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: real(path)._replace(free=1000))
    plan, out = write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2), tmp_path / "run"
    p = run_cli(capsys, "train", "--plan", plan, "--out", out, "--device", "cpu", "--steps", "2")
    assert_one_line_error(
        p, f"{out / 'checkpoints'}: disk full: needs about", "parameters: fp32 weights", "1,000 bytes"
    )
    assert not out.exists()


def test_the_update_waits_for_the_writers_copy_and_without_the_wait_the_file_is_wrong(tmp_path, monkeypatch):
    """The writer thread copies the state while the next step computes; `copied` holds the update back until the
    copy is made. The copy is held here until the test lets it go (no timing): the wait returns only after it, and a
    change made without the wait is what the file saves."""
    release, done = threading.Event(), []
    real = checkpoint.host_copy

    def held_copy(obj):
        release.wait()
        done.append(1)
        return real(obj)

    monkeypatch.setattr(checkpoint, "host_copy", held_copy)
    weights, writer = torch.zeros(1000), StageWriter()
    writer.start(tmp_path, 1, 0, 1, {"w": weights}, {})
    threading.Timer(0.05, release.set).start()
    writer.copied()
    assert done  # the copy was made before the wait returned
    weights += 1
    writer.wait()
    assert torch.equal(checkpoint.load_stage(tmp_path, 1, 0)["model"]["w"], torch.zeros(1000))

    release.clear()  # the negative control: the update made without the wait, while the copy is held
    writer.start(tmp_path, 2, 0, 1, {"w": weights}, {})
    weights += 1
    release.set()
    writer.wait()
    assert torch.equal(checkpoint.load_stage(tmp_path, 2, 0)["model"]["w"], torch.full((1000,), 2.0))
