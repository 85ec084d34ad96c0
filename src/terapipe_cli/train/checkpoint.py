"""Checkpoints: one file per stage, complete only when a marker says every stage wrote its file.

    checkpoints/step_000010/stage_000.pt      {"schema": "terapipe.checkpoint/1", "step", "stage", "stages",
    checkpoints/step_000010/stage_001.pt       "model": state_dict, "optimizer": state_dict}
    checkpoints/step_000010/complete.json     {"schema": "terapipe.checkpoint-marker/1", "step", "stages", "files"}

Each stage file is written atomically (`terapipe_cli.files`). Completeness is decided through the process
group: every rank reaches the checkpoint's all-reduce only after writing its file, so once that all-reduce
returns, every stage of the step is on disk somewhere. Then one worker per run folder writes that folder's
marker (also atomically), listing the stage files the folder holds: all of them in a folder every node
shares, the node's own stages in a node-local one (docs/design.md §6). A run killed at any moment therefore
leaves the last *marked* checkpoint intact, and `latest_complete` ignores a half-written one. Replicas hold
identical weights, so one rank per stage and folder writes. The two newest complete checkpoints are kept.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import torch

from terapipe_cli.files import read_json, write_bytes_atomic, write_json_atomic

CHECKPOINT_SCHEMA = "terapipe.checkpoint/1"
MARKER_SCHEMA = "terapipe.checkpoint-marker/1"
MARKER = "complete.json"
KEEP = 2


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def stage_file(run_dir: str | Path, step: int, stage: int) -> Path:
    return step_dir(run_dir, step) / f"stage_{stage:03d}.pt"


def save_stage(run_dir: str | Path, step: int, stage: int, stages: int, model: dict, optimizer: dict) -> Path:
    record = {
        "schema": CHECKPOINT_SCHEMA,
        "step": step,
        "stage": stage,
        "stages": stages,
        "model": model,
        "optimizer": optimizer,
    }
    return save_torch_atomic(stage_file(run_dir, step, stage), record)


def save_torch_atomic(path: str | Path, obj: object) -> Path:
    """``torch.save`` to ``path`` all at once: a reader sees the old file or the whole new one."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return write_bytes_atomic(path, buffer.getvalue())


def mark_complete(run_dir: str | Path, step: int, stages: int, held: list[int] | None = None) -> None:
    """Call once every stage file of ``step`` is written (the process group said so); ``held``: the stages
    whose files this folder holds (default all). Then prune older checkpoints."""
    held = list(range(stages)) if held is None else sorted(held)
    files = [stage_file(run_dir, step, k).name for k in held]
    missing = [f for f in files if not (step_dir(run_dir, step) / f).exists()]
    if missing:
        raise RuntimeError(f"checkpoint of step {step} lacks {missing}")
    write_json_atomic(
        step_dir(run_dir, step) / MARKER, {"schema": MARKER_SCHEMA, "step": step, "stages": stages, "files": files}
    )
    for old in complete_steps(run_dir)[:-KEEP]:
        shutil.rmtree(step_dir(run_dir, old), ignore_errors=True)


def complete_steps(run_dir: str | Path) -> list[int]:
    """Steps with a complete checkpoint, ascending."""
    root = Path(run_dir) / "checkpoints"
    steps = []
    if root.is_dir():
        for d in root.iterdir():
            if d.name.startswith("step_") and (d / MARKER).is_file():
                try:
                    marker = read_json(d / MARKER, schema=MARKER_SCHEMA, what="checkpoint marker")
                except Exception:
                    continue
                if all((d / f).is_file() for f in marker.get("files", [])):
                    steps.append(int(marker["step"]))
    return sorted(steps)


def latest_complete(run_dir: str | Path) -> int | None:
    steps = complete_steps(run_dir)
    return steps[-1] if steps else None


def load_stage(run_dir: str | Path, step: int, stage: int, map_location: str | torch.device = "cpu") -> dict:
    obj = torch.load(stage_file(run_dir, step, stage), map_location=map_location, weights_only=True)
    if obj.get("schema") != CHECKPOINT_SCHEMA or obj.get("step") != step or obj.get("stage") != stage:
        raise RuntimeError(f"{stage_file(run_dir, step, stage)}: not the checkpoint of stage {stage} at step {step}")
    return obj
