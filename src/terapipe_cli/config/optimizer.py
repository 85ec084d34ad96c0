"""The optimizer's own config (torchtitan's optimizer ``Config``): AdamW's settings, declared once.

`engine.optim.make_optimizer` takes it whole — for the workers (`engine.trainer`) and for ``--verify``'s
single-process reference (`train.verify`) alike, so both build the same AdamW. Each field is also a setting of
`terapipe train`: `config.run.RunConfig` and `config.run.RunArguments` include these fields
(`config.fields.include_settings`), so the flag (``--weight-decay``), the ``[train]`` key, the resume rule, run.toml
and the report's same-settings check all derive from the declaration here. A new optimizer setting is one field.

The defaults are nanoGPT's (GPT-3's betas): weight decay 0.1 on every matrix — the embeddings and the LM head
included — and none on norms and biases. Imports no torch, so the settings are read and checked without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from terapipe_cli.config.fields import doc_of, out_of_bounds, setting
from terapipe_cli.errors import UserError

OPTIMIZER = "Optimizer step"  # their help panel in `terapipe train --help`


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW's settings. A resumed run keeps them all ("keep"): another weight decay, beta or eps changes every later
    update, so the run would no longer be the one its checkpoints began."""

    weight_decay: float = setting(
        "AdamW's decoupled weight decay on every matrix (the embeddings and the head too, unless "
        "--no-decay-embeddings); norms and biases never decay.",
        0.1,
        minimum=0,
        panel=OPTIMIZER,
        resume="keep",
    )
    beta1: float = setting(
        "AdamW's decay rate of its gradient average (the first moment).",
        0.9,
        minimum=0,
        below=1,
        panel=OPTIMIZER,
        resume="keep",
    )
    beta2: float = setting(
        "AdamW's decay rate of its squared-gradient average (the second moment).",
        0.95,
        minimum=0,
        below=1,
        panel=OPTIMIZER,
        resume="keep",
    )
    eps: float = setting(
        "AdamW's epsilon, added to the root of the second moment.", 1e-8, positive=True, panel=OPTIMIZER, resume="keep"
    )
    decay_embeddings: bool = setting(
        "Weight decay on the token and position embeddings and the LM head as on the other matrices "
        "(--no-decay-embeddings: none on them; with tied embeddings, the one matrix).",
        True,
        panel=OPTIMIZER,
        resume="keep",
    )

    def __post_init__(self) -> None:
        """Each value within its field's bounds, and finite: a one-line `UserError` (a ValueError) naming it."""
        for f in fields(self):
            value = getattr(self, f.name)
            problem = out_of_bounds(value, doc_of(f))
            if problem is None and isinstance(value, float) and not math.isfinite(value):
                problem = f"must be a finite number, got {value}"
            if problem is not None:
                raise UserError(problem, where=f.name)

    @property
    def betas(self) -> tuple[float, float]:
        return (self.beta1, self.beta2)
