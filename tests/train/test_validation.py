"""The held-out (validation) loss: a split of the data, evaluated through the same pipeline, forward only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from terapipe_cli.engine.data import TokenData, split_data, validation_batch
from terapipe_cli.errors import UserError

CPU = ("--device", "cpu")


def test_the_held_out_part_is_the_end_of_the_data():
    data = TokenData("x", "tokens", np.arange(1000) % 256, 255)
    train, held_out = split_data(data, 0.1, seq_len=32)
    assert len(train) == 900 and len(held_out) == 100
    assert held_out.tokens[0] == data.tokens[900]
    assert split_data(data, 0.0, seq_len=32) == (data, None)
    # The validation batch is the same at every evaluation, and drawn from the held-out part only.
    a = validation_batch(held_out, seed=0, sequences=3, seq_len=32)
    assert torch.equal(a, validation_batch(held_out, seed=0, sequences=3, seq_len=32))
    starts = [int(np.flatnonzero(held_out.tokens == row[0].item())[0]) for row in a]
    assert all(0 <= s <= 100 - 33 for s in starts)
    with pytest.raises(UserError, match="--val-fraction"):
        split_data(data, 0.99, seq_len=32)
    with pytest.raises(UserError, match=r"\[0, 1\)"):
        split_data(data, 1.0, seq_len=32)


def test_no_held_out_data_means_no_validation(tmp_path):
    from conftest import local_setup, train_locally, write_plan_file

    from terapipe_cli.config.run import RunConfig
    from terapipe_cli.train.prepare import prepare_run

    plan = write_plan_file(tmp_path / "plan.json", [(1, [32])], stages=2)
    prepared = prepare_run(RunConfig(plan=str(plan), steps=2, val_fraction=0.0, device="cpu"), write=False)
    assert prepared.args.eval_every == 0
    run = train_locally(local_setup([(1, [32])], stages=2, steps=2, val_fraction=0.0, eval_every=0))
    assert run.val_losses == [None, None]
