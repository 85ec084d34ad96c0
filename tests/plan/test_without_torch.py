"""Planning needs no PyTorch (docs/design.md: the plan stage imports none): in a Python where `import torch` fails,
the plan package and `terapipe plan` work, every test module of this folder imports, and the planner's own tests
pass."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

# Makes `import torch` fail in the child, as on a machine without it.
NO_TORCH = """
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)")
        return None
sys.meta_path.insert(0, NoTorch())
"""


def _run(code: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH + code, *argv], capture_output=True, text=True, cwd=ROOT, timeout=600,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip


def test_terapipe_plan_and_the_planner_tests_run_without_torch(tmp_path):
    code = f"""
import pkgutil, terapipe_cli.plan as plan
for m in pkgutil.iter_modules(plan.__path__):
    __import__("terapipe_cli.plan." + m.name)
import terapipe_cli.planner, terapipe_cli.costmodel
from terapipe_cli.cli import main
try:
    main(["plan", "--profile", "configs/profiles/tiny-cpu-measured.json", "-k", "2", "-b", "2",
          "--memory-limit", "0.0376", "--show-schedule", "--out", {str(tmp_path / "plan.json")!r}])
except SystemExit as e:
    assert e.code == 0, e.code
assert "torch" not in sys.modules
import pytest
# Every test module of tests/plan imports (collects) without torch, and a share of them runs: the schedule and the
# cost model (the whole folder, the recorded plans among it, runs in the suite's own session).
assert pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--collect-only", "tests/plan"]) == 0
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:xdist", "tests/plan/test_schedule.py",
                      "tests/plan/test_costmodel.py"]))
"""
    p = _run(code)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "planned within" in p.stdout and "stage 0" in p.stdout
    assert " passed" in p.stdout and "failed" not in p.stdout
