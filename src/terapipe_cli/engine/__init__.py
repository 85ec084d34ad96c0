"""The engine: what one rank runs (docs/design.md §6). The model (`terapipe_cli.models`) knows nothing of
parallelism; the engine applies it.

stage.py     StageRunner: one stage's per-tile forward and backward, with the K/V gradient hand-back
loss.py      the LM head and its cross-entropy a chunk of tokens at a time; the summed token loss
tensor.py    tensor parallelism inside a stage (Megatron's split), applied to a plain model from outside
p2p.py       pre-posted point-to-point messages between neighbouring stages (shapes from the plan)
mesh.py      where every rank sits in the (data, pipeline, tensor) grid, and its process groups
optim.py     the optimizer step: lr schedule, global-norm clipping, fp16 loss scale, AdamW
data.py      token data and the deterministic batches of each step
torchrun.py  how ranks are started: torchrun's command line and environment

`terapipe profile` times tiles through `StageRunner`; `terapipe train`'s workers (`train.worker`) run it all.
"""

import resource
import sys

from terapipe_cli.errors import UserError


def require_torch(where: str) -> None:
    """The runtime's modules import PyTorch; without it, one line that says how to get it."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UserError("needs PyTorch in this Python (see scripts/setup.sh)", where=where) from None


def peak_rss_bytes() -> int:
    """The peak resident set of this process alone: Linux's VmHWM. Not ``getrusage``'s ``ru_maxrss``: Linux carries
    that over an exec, so a worker torchrun starts would report its launcher's peak (the demo's workers showed the
    launcher's 2460 MiB where each had used about 400 MB). A worker forked from the launcher (`engine.forking`) counts
    the pages it still shares with it, as a fresh one counts the torch it imported. Elsewhere ``ru_maxrss`` (macOS:
    bytes, not KiB)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # in kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024
