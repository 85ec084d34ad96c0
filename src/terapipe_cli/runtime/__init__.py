"""The runtime (docs/design.md §6): torchrun-launched stage workers that execute a plan's schedule.

stage.py       StageRunner: one stage's per-tile forward/backward with the K/V gradient hand-back
p2p.py         pre-posted point-to-point messages between neighbouring stages (shapes from the plan)
prepare.py     everything `terapipe train` checks before a worker starts, and the run directory it writes
worker.py      one torchrun worker: walks the schedule, all-reduces gradients, steps AdamW, records
launch.py      builds and runs the torchrun command; turns a worker failure into one line
data.py        token data (text bytes or uint16 tokens) and the deterministic batches of each step
checkpoint.py  atomic per-stage checkpoints, complete only when a marker says so
verify.py      the single-process reference and the comparison behind ``--verify``
rundir.py      the run directory's files and their schemas
"""

from terapipe_cli.errors import UserError


def require_torch(where: str) -> None:
    """The runtime's modules import PyTorch; without it, one line that says how to get it."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UserError("needs PyTorch in this Python (see scripts/setup.sh)", where=where) from None
