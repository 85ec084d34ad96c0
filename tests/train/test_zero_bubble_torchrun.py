"""ZB-V through real torchrun workers (gloo on the CPU), the smoke tier of the zero-bubble orders: two stage processes
each holding two chunks in a V (process k: chunks k and 3 − k), every backward split into I and W, --verify against the
single device; the timelines hold every tile's F, I and W on both chunks. (Every case in one process:
tests/engine/test_zero_bubble_training.py.)"""

from __future__ import annotations

from conftest import run_cli, write_plan_file

from terapipe_cli.plan.schedule import plan_tiles
from terapipe_cli.plan.timeline import read_timeline
from terapipe_cli.train.rundir import read_summary, timeline_path


def test_zb_v_on_two_processes_verifies(tmp_path, capfd):
    slices = [(1, [20, 12]), (1, [5, 5, 22])]
    plan = write_plan_file(
        tmp_path / "plan.json", slices, stages=2, order="zbv", virtual_stages=2, recompute=[False, True, False, False]
    )
    out = tmp_path / "run"
    p = run_cli(capfd, "train", "--plan", plan, "--steps", "2", "--out", out, "--verify", "--device", "cpu")
    assert p.returncode == 0, p.stdout + p.stderr
    assert read_summary(out)["verify"]["ok"] is True
    for rank in range(2):
        _, events = read_timeline(timeline_path(out, rank))
        step = [e for e in events if e.step == 1]
        assert sorted({e.chunk for e in step}) == sorted({rank, 3 - rank})
        assert sorted(e.phase for e in step) == sorted("FIW" * 2 * len(plan_tiles(slices)))
