"""``terapipe export``: a run's per-stage checkpoint as ONE single-device model file.

Every stage keeps its layers under their global names (``blocks.5...``, docs/design.md §6), so the stages' state
dicts join without renaming into the state dict of the whole model, `terapipe_cli.models.build_model(cfg)` (the
module of the architecture ``cfg.arch`` names: `GPT`, `GPT2`, `Llama`).

The file (``torch.save``, ``weights_only``-loadable) holds ``{"schema": "terapipe.export/1", "model_config": {...},
"step", "run", "state_dict"}``; `load_exported` (also ``terapipe_cli.load_exported``) rebuilds the model from it with
``strict=True``. ``--format hf`` writes a Hugging Face folder instead (`train.hf`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from terapipe_cli.errors import UserError
from terapipe_cli.models import ModelConfig, build_model
from terapipe_cli.models.decoder import Decoder
from terapipe_cli.plan.file import plan_from_dict
from terapipe_cli.train import checkpoint
from terapipe_cli.train.rundir import read_config

EXPORT_SCHEMA = "terapipe.export/1"


def export_state(run_dir: Path, step: int | None = None) -> tuple[ModelConfig, int, dict[str, torch.Tensor]]:
    """(model config, step, the whole model's state dict) from the run's complete checkpoint of ``step`` (default:
    the latest). One-line `UserError` when the run or the checkpoint is not there."""
    where = str(run_dir)
    if not (run_dir / "config.json").is_file():
        raise UserError("not a run folder (no config.json): give the --out of a `terapipe train`", where=where)
    cfg, _ = read_config(run_dir)
    plan = plan_from_dict(cfg["plan"], f"{run_dir / 'config.json'}: field 'plan'")
    step = verified_step(run_dir, step)
    try:
        state = checkpoint.read_state(run_dir, step, model_config=plan.model.to_dict()).model
    except checkpoint.CheckpointMismatch as e:
        raise UserError(str(e), where=str(run_dir)) from None
    expected = single_device_model(plan.model).state_dict()
    if set(state) != set(expected):
        missing = sorted(set(expected) ^ set(state))[:3]
        raise UserError(
            f"the stages' weights do not make the whole model (names differ: {missing})", where=str(run_dir)
        )
    wrong = next((n for n, t in expected.items() if state[n].shape != t.shape), None)
    if wrong is not None:
        raise UserError(
            f"the checkpoint's {wrong!r} has the shape {tuple(state[wrong].shape)}, "
            f"the model's {tuple(expected[wrong].shape)}",
            where=str(run_dir),
        )
    return plan.model, step, state


def verified_step(run_dir: Path, step: int | None) -> int:
    """The checkpoint to read, its files checked against their manifest's sizes and checksums exactly as --resume
    checks them: ``step``'s (one line if it is damaged), or the newest that passes (one line on stderr naming each
    newer one passed over and why)."""
    if step is not None:
        steps = checkpoint.step_folders(run_dir)
        if step not in steps:
            complete = checkpoint.complete_steps(run_dir)
            raise UserError(
                f"no complete checkpoint of step {step}; complete: {', '.join(map(str, complete)) or 'none'}",
                where="--step",
            )
        problem = checkpoint.check_step(run_dir, step)
        if problem is not None:
            raise UserError(f"the checkpoint of step {step} is not usable ({problem})", where=str(run_dir))
        return step
    found, passed_over = checkpoint.latest_verified(run_dir)
    if found is None:
        why = f": {'; '.join(passed_over)}" if passed_over else " (one is written every --checkpoint-every steps)"
        raise UserError(f"has no complete checkpoint{why}", where=str(run_dir))
    if passed_over:
        print(f"terapipe: {'; '.join(passed_over)}: using step {found}", file=sys.stderr, flush=True)
    return found


def single_device_model(cfg: ModelConfig) -> Decoder:
    """The whole model of ``cfg`` on one device, of its architecture (its weights as initialised: a state dict is
    loaded into it)."""
    return build_model(cfg)


def run_model(run_dir: Path, step: int | None = None) -> tuple[Decoder, int]:
    """The single-device model of a run's complete checkpoint of ``step`` (default: the latest), in eval mode."""
    cfg, step, state = export_state(run_dir, step)
    model = single_device_model(cfg)
    model.load_state_dict(state, strict=True)
    return model.eval(), step


def write_export(path: Path, run_dir: Path, model: ModelConfig, step: int, state: dict[str, torch.Tensor]) -> None:
    record = {
        "schema": EXPORT_SCHEMA,
        "model_config": model.to_dict(),  # as a model TOML gives it: a GPT model's as before arch existed
        "step": step,
        "run": str(run_dir.resolve()),
        "state_dict": state,
    }
    checkpoint.save_torch_atomic(path, record)


def load_exported(path: str | Path, map_location: str | torch.device = "cpu") -> tuple[Decoder, dict]:
    """The single-device model of an export file (``strict=True``, eval mode), and the file's record without the
    weights: ``{"schema", "model_config" (a dict: `ModelConfig`'s fields), "step", "run"}``."""
    record = read_export(path, map_location)
    model = single_device_model(exported_model(record, path))
    model.load_state_dict(record.pop("state_dict"), strict=True)
    return model.eval(), record


def read_export(path: str | Path, map_location: str | torch.device = "cpu", *, mmap: bool = False) -> dict:
    """An export file's record, checked to be one (one line otherwise); ``mmap``: its tensors memory-mapped, read
    from disk only where used (`train.init_from` reads a stage's tensors so)."""
    where = str(path)
    if not Path(path).is_file():
        raise UserError("no such export file (`terapipe export RUN --out FILE` writes one)", where=where)
    try:
        record = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # not a torch file, or one holding more than tensors and plain data
        raise UserError(f"not a terapipe export ({type(e).__name__})", where=where) from None
    if not isinstance(record, dict) or record.get("schema") != EXPORT_SCHEMA:
        raise UserError(f"not a terapipe export (schema {EXPORT_SCHEMA})", where=where)
    return record


def exported_model(record: dict, path: str | Path) -> ModelConfig:
    """The model config of an export's record (`read_export`)."""
    return ModelConfig.from_dict(record["model_config"], str(path), prefix="model_config.")
