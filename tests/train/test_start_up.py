"""What a process of the runtime loads when it starts: the worker, `terapipe train`'s launcher and `terapipe profile`
import torch, but not its compiler stack (``torch._dynamo``, sympy): 2.5 s of CPU on a two-core machine, as much
again as torch itself. A process that needs it imports it where it runs: `models.attention`'s CUDA mask, the memory
tracer's fake tensors. Nor does an optimizer step load it: torch.optim's optimizers do, the first time one of their
methods runs, so the runtime's AdamW (`engine.optim.AdamW`) is built on torch's functional update instead."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

STARTS = ("terapipe_cli.train.worker", "terapipe_cli.train.launch", "terapipe_cli.profile.measure")


def test_the_runtime_starts_without_torchs_compiler():
    code = f"""
import sys
for name in {STARTS!r}:
    __import__(name)
print(sorted(m for m in ("torch._dynamo", "torch._inductor", "sympy") if m in sys.modules))
import torch
from terapipe_cli.engine.optim import make_optimizer, take_step
module = torch.nn.Linear(4, 4)
optimizer = make_optimizer(module, 1e-3)
module(torch.ones(4)).sum().backward()
take_step(optimizer, list(module.parameters()), max_norm=1.0)
optimizer.zero_grad(set_to_none=True)
print(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
"""
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["[]", "[]"], p.stdout  # started; then an optimizer step taken
