"""The runtime's test-only switches, in one record (`Controls`).

Each switch breaks one thing the tests must see fail — a negative control that ``--verify`` must catch (the K/V
gradient hand-back dropped, a tensor-parallel all-reduce skipped, rotary positions restarting at each slice, the
document mask dropped over the K/V cache), or a worker failure the failure paths must survive (`fault`). The
defaults are the correct runtime, and a run without a switch set records none.

How a switch reaches the code it breaks: a launch (`terapipe train`) reads `CONTROLS_ENV` — one environment
variable, ``name=value`` pairs separated by commas (``kv_handback=off``, ``fault=kill:1:3``) — into the run's
resolved arguments (`config.run.RunArguments.controls`), which its ``config.json`` carries to torchrun's workers; no
other variable crosses into them. The workers hand the record to the stage (`engine.stage.StageRunner`) and the
tensor group; a test that runs ranks in one process passes it in the arguments itself. Each launch reads it anew, so
a resumed run (or a requeued job) carries only the switches of its own launch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from terapipe_cli.errors import UserError

CONTROLS_ENV = "TERAPIPE_TEST_CONTROLS"
_ON, _OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


@dataclass(frozen=True)
class Controls:
    """Every test-only switch of the runtime; the defaults are the correct runtime."""

    kv_handback: bool = True  # False: the earlier token slices' K/V gradients dropped (`attention.KVCache`)
    tp_allreduce: bool = True  # False: the backward all-reduce of the column-parallel inputs skipped (`tensor`)
    vocab_allreduce: bool = True  # False: the vocabulary-parallel loss's all-reduces skipped (`engine.loss`)
    rope_absolute: bool = True  # False: every slice rotates by the positions 0 … i − 1 (`models.llama.module`)
    cache_masked: bool = True  # False: the document mask dropped over the K/V cache's rows (`attention.DocumentMask`)
    fault: str | None = None  # "KIND:RANK:STEP": a failure injected in one worker's step (train/worker.py)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Controls:
        """The switches `CONTROLS_ENV` sets (none when it is unset or empty); a name or value it cannot be is one
        line."""
        text = (os.environ if environ is None else environ).get(CONTROLS_ENV, "").strip()
        kinds = {f.name: f.type for f in fields(cls)}
        values: dict[str, object] = {}
        for pair in filter(None, (p.strip() for p in text.split(","))):
            name, _, value = pair.partition("=")
            name, value = name.strip(), value.strip()
            if name not in kinds:
                raise UserError(f"{name!r} is no test switch (known: {', '.join(kinds)})", where=CONTROLS_ENV)
            if name == "fault":
                values[name] = value or None
            elif value.lower() in _ON + _OFF:
                values[name] = value.lower() in _ON
            else:
                raise UserError(f"{name} must be on or off, got {value!r}", where=CONTROLS_ENV)
        return cls(**values)

    def record(self) -> dict | None:
        """The switches set (their values), as a run's arguments keep them; None when none is."""
        changed = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}
        return changed or None

    @classmethod
    def of(cls, record: Mapping | None) -> Controls:
        """The record of `record` (a run's ``controls``; None: none set)."""
        return cls(**dict(record or {}))
