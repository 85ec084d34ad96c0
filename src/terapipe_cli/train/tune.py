"""The training side of `terapipe plan --tune` (`plan.tune` chooses): this machine's device as a profile records
one, and a few steps of a candidate plan trained as `terapipe train` trains it — its preparation and its torchrun
workers, one process per rank — timed by the workers themselves (metrics.jsonl's ``iteration_s``)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

from terapipe_cli.config.run import RunConfig
from terapipe_cli.errors import Interrupted, Stopped, UserError
from terapipe_cli.files import write_json_atomic
from terapipe_cli.plan import tune
from terapipe_cli.plan.choice import Planned
from terapipe_cli.plan.configs import Configured
from terapipe_cli.plan.costmodel import Profile
from terapipe_cli.train.baseline import following
from terapipe_cli.train.launch import WorkerFailed, launch
from terapipe_cli.train.prepare import prepare_run
from terapipe_cli.train.rundir import read_metrics

Tuner = Callable[[Configured, Callable[[Planned], dict], Callable[[str], None] | None], tune.Tuned]


def tuner(profile: Profile, count: int, scheme: str, *, data: bool = False) -> Tuner:
    """``terapipe plan --tune count``, checked before anything is planned (`plan.tune.check_tunable`): the function
    that trains the simulator's best ``count`` plans of a configured plan (`plan.tune.candidates`) in rounds here
    and returns them measured (`plan.tune.tune`)."""
    here = this_device(profile)
    tune.check_tunable(profile, here, count=count, scheme=scheme, data=data)
    measure = partial(train_steps, device=here["kind"])

    def run(configured: Configured, to_dict: Callable[[Planned], dict], progress=None) -> tune.Tuned:
        plans = tune.candidates(configured, count)
        return tune.tune(plans, to_dict, measure, device=here["name"], progress=progress)

    return run


def this_device(profile: Profile) -> dict:
    """``{"kind", "name"}`` of the device here of the profile's kind, as `terapipe profile` records it (a CPU
    profile's kind on a machine with GPUs is its CPU; a GPU profile's on a machine without one is the CPU)."""
    import torch

    from terapipe_cli.profile.probe import device_info

    cuda = profile.device.get("kind") == "cuda" and torch.cuda.is_available()
    info = device_info(torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"))
    return {"kind": info["kind"], "name": info["name"]}


def train_steps(plan: dict, steps: int, *, device: str) -> list[float]:
    """The seconds of each of ``steps`` steps of ``plan`` (a plan file's object) trained on ``device`` in a folder
    of its own, removed after; a worker's failure is one line."""
    with tempfile.TemporaryDirectory(prefix="terapipe-tune-") as tmp:
        path, out = Path(tmp) / "plan.json", Path(tmp) / "run"
        write_json_atomic(path, plan)
        # No clipping and no held-out data: the step alone, as bench_peer_train times a run.
        settings = RunConfig(plan=str(path), out=str(out), steps=steps, device=device, grad_clip=0.0, val_fraction=0.0)
        prepared = prepare_run(settings, write=True)
        try:
            with following(out, steps, lambda *_: None):  # no step lines: `plan.tune` tells the rounds
                launch(prepared.launch)
        except WorkerFailed as e:
            raise UserError(f"training a candidate plan failed: {e}", where="--tune") from None
        except Stopped as e:  # the run's own line names a folder about to be removed
            raise Stopped(
                "--tune: stopped while a candidate plan trained; no plan written", e.exit_code - 128
            ) from None
        except Interrupted:
            raise Interrupted("--tune: interrupted while a candidate plan trained; no plan written") from None
        return [float(r["iteration_s"]) for r in read_metrics(out)]
