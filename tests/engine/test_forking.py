"""torchrun's agent in a forked child with its workers forked from it (`engine.forking.run_agent_in_child`, which
`terapipe profile`'s measurements on gloo run through): the workers run the module's main in this process's
image, and a failure or a hang comes back as an exit code or a time-out, the hung processes gone. The training
launcher's own use (`launch_forked` in its process) is the torchrun tier's (tests/train)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from terapipe_cli.engine.forking import run_agent_in_child
from terapipe_cli.engine.torchrun import rendezvous_args


def probe(tmp_path, mode: str, timeout_s: float = 120):
    args = [*rendezvous_args(2), "--module", "forked_probe", "--out", str(tmp_path), "--mode", mode]
    code = run_agent_in_child(args, output=tmp_path / "output.txt", timeout_s=timeout_s)
    seen = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank_*.json"))]  # the ranks that started
    return code, seen, (tmp_path / "output.txt").read_text()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a killed process whose parent has not reaped it yet is a zombie: not running)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_forked_workers_run_the_module_in_this_processs_image(tmp_path):
    code, seen, _ = probe(tmp_path, "ok")
    assert code == 0 and len(seen) == 2
    assert all(s["forked"] for s in seen)  # a fresh interpreter would not have imported engine.forking
    assert len({s["pid"] for s in seen} | {os.getpid()}) == 3
    assert all(s["session"] != os.getsid(0) for s in seen)  # the agent's own session, not the caller's


def test_a_failing_worker_is_an_exit_code_and_its_error_line(tmp_path):
    code, _, output = probe(tmp_path, "raise")
    assert code not in (0, None)
    assert "ValueError: the probe's failure on rank 1" in output


def test_a_hang_is_a_time_out_and_leaves_no_process(tmp_path):
    code, seen, _ = probe(tmp_path, "hang", timeout_s=5)  # the agent and its workers start within a second or two
    assert code is None and seen, "no worker started within the time-out"
    deadline = time.monotonic() + 30  # killed at once; a large process takes a moment to end
    while any(alive(s["pid"]) for s in seen):
        assert time.monotonic() < deadline, "a hung worker outlived the time-out"
        time.sleep(0.05)
