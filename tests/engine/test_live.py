"""With ``--track-memory`` the first step a CPU run takes is tracked (`engine.live.LiveBytes` on real tensors,
`Trainer.step`): the most bytes live at once, the measured side of the plan's estimate less the state
(report/compare.py). It counts what the fake-tensor walk of the same schedule counts
(`profile.memtrace.tracked_step_peaks`, the estimate's own tracker), and tracking a step changes nothing it computes."""

from __future__ import annotations

import pytest
import torch
from conftest import local_setup, train_locally

from terapipe_cli.profile.memtrace import tracked_step_peaks
from terapipe_cli.schedule.schedule import Schedule


@pytest.mark.parametrize(
    "slices, stages, precision",
    [([(2, [16, 16])], 2, "fp32"), ([(1, [32])] * 2, 2, "fp32"), ([(2, [8, 8, 8, 8])], 1, "bf16")],
    ids=["K=2 token slices", "K=2 batch slices", "K=1 bf16"],
)
def test_the_first_step_is_tracked_as_the_fake_walk_counts_it(slices, stages, precision):
    setup = local_setup(slices, stages=stages, layers=4, seq_len=32, steps=2, precision=precision, track_memory=True)
    run = train_locally(setup)
    first, second = run.live
    assert second is None  # one step only: the tracker slows every op
    walked = tracked_step_peaks(setup.plan.model, Schedule.of_plan(setup.plan), precision=precision)
    assert len(first) == stages
    for got, want in zip(first, walked, strict=True):
        # The walk makes each tile's input and targets inside it (a real step's batch exists before): a few KiB.
        assert got == pytest.approx(want, rel=0.05)
        assert got > 0


def test_tracking_a_step_changes_nothing_it_computes():
    def trained(track_memory: bool):
        return train_locally(local_setup([(2, [16, 16])], stages=2, layers=4, seq_len=32, steps=2,
                                         track_memory=track_memory))  # fmt: skip

    tracked, plain = trained(True), trained(False)
    assert plain.live == [None, None] and tracked.live[0] is not None
    assert tracked.losses == plain.losses
    for name, g in plain.grads.items():
        assert torch.equal(tracked.grads[name], g), name
    for name, w in plain.weights.items():
        assert torch.equal(tracked.weights[name], w), name
