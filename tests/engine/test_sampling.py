"""How a step's windows are drawn: several sources by weight (`Mixture`), ``--sampling epoch``
(shuffled non-overlapping windows, each once per epoch, as Megatron-LM's dataset) beside the random windows,
``--val-data`` (the held-out loss from a file of its own); exact under ``--verify`` and after a resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import local_setup, verify_locally
from local_world import LocalWorld, continued_in_new_trainers, local_comms

from terapipe_cli.engine.data import (
    Mixture,
    TokenData,
    epoch_windows,
    epochs_done,
    generate_default_text,
    step_batch,
    step_documents,
    step_windows,
    window_offsets,
)
from terapipe_cli.engine.mesh import Layout
from terapipe_cli.engine.trainer import Trainer
from terapipe_cli.schedule.schedule import Schedule


def test_epoch_windows_are_shuffled_and_each_drawn_once_per_epoch():
    tokens = np.arange(1001, dtype=np.uint16)
    data = TokenData("ids", "tokens", tokens, 1000, "npy", ".npy")
    L, n = 10, 4
    W = epoch_windows(data, L)
    assert W == 100
    offsets = np.concatenate(
        [window_offsets(data, seed=3, step=s, sequences=n, seq_len=L, sampling="epoch") for s in range(1, 51)]
    )
    first, second = offsets[:W], offsets[W:]
    assert sorted(first) == list(range(0, 1000, L)) == sorted(second)  # every window once per epoch
    assert list(first) != sorted(first) and list(first) != list(second)  # shuffled, anew each epoch
    batch = step_batch(data, seed=3, step=2, sequences=n, seq_len=L, sampling="epoch")
    assert batch[:, 0].tolist() == offsets[n : 2 * n].tolist() and batch.shape == (n, L + 1)
    assert (batch[:, 1:] - batch[:, :-1] == 1).all()  # the window and its next token
    assert epochs_done(data, step=50, sequences=n, seq_len=L) == 2.0
    with pytest.raises(ValueError, match="sampling"):
        window_offsets(data, seed=0, step=1, sequences=1, seq_len=L, sampling="sequential")


def _ids(n: int, first: int) -> TokenData:
    return TokenData(f"ids{first}", "tokens", np.arange(first, first + n, dtype=np.int64), first + n - 1, "npy", ".npy")


def test_a_mixture_draws_each_source_by_its_weight_from_the_seed_and_step():
    mix = Mixture((_ids(1001, 0), _ids(501, 10_000)), (0.7, 0.3))
    draws = [step_windows(mix, seed=1, step=s, sequences=8, seq_len=10) for s in range(1, 201)]
    share = np.mean([d is mix.sources[0] for step in draws for d, _ in step])
    assert share == pytest.approx(0.7, abs=0.03)
    assert step_windows(mix, seed=1, step=7, sequences=8, seq_len=10) == draws[6]  # a pure function of seed and step
    assert step_windows(mix, seed=2, step=7, sequences=8, seq_len=10) != draws[6]
    batch = step_batch(mix, seed=1, step=3, sequences=8, seq_len=10)
    assert [int(r[0]) >= 10_000 for r in batch] == [d is mix.sources[1] for d, _ in draws[2]]
    # Epoch sampling: each source's windows once per its own epoch, whatever the other source drew.
    fresh = Mixture(mix.sources, mix.weights)
    epoch = [step_windows(fresh, seed=1, step=s, sequences=8, seq_len=10, sampling="epoch") for s in range(1, 31)]
    small = [o for step in epoch for d, o in step if d is mix.sources[1]]
    assert sorted(small[:50]) == list(range(0, 500, 10))
    again = Mixture(mix.sources, mix.weights)  # resumed at step 20: the counts replayed from the seed
    assert step_windows(again, seed=1, step=20, sequences=8, seq_len=10, sampling="epoch") == epoch[19]
    assert epochs_done(mix, step=10, sequences=8, seq_len=10) == pytest.approx(80 / 150)


@pytest.fixture
def val_file(tmp_path):
    path = tmp_path / "held-out.txt"
    path.write_text(generate_default_text(20_000, seed=99))
    return str(path)


def test_epoch_sampling_and_a_validation_file_verify(val_file):
    setup = local_setup([(1, [12, 20]), (1, [32])], stages=2, sampling="epoch", val_data=val_file, val_fraction=0.0)
    assert setup.held_out.path == val_file and len(setup.data) == len(generate_default_text())  # all of --data
    result, _ = verify_locally(setup)
    assert result.ok, result.to_dict()


@pytest.fixture
def mixture(tmp_path):
    """Two text sources: the embedded stories, and other stories, 2:1."""
    other = tmp_path / "other.txt"
    other.write_text(generate_default_text(60_000, seed=11))
    return [f"{2 / 3!r}:{default_text()}", f"{1 / 3!r}:{other}"]


def default_text() -> str:
    from terapipe_cli.engine.data import default_data_path

    return str(default_data_path())


def test_a_mixture_with_documents_masked_verifies(mixture):
    setup = local_setup(
        [(1, [12, 20]), (1, [32])], stages=2, data=default_text(), data_mix=mixture, document_mask=True, eos_id=10
    )
    assert isinstance(setup.data, Mixture) and isinstance(setup.held_out, Mixture)
    docs = step_documents(setup.data, seed=0, step=1, sequences=2, seq_len=32, eos=10)
    assert docs.shape == (2, 32)
    result, _ = verify_locally(setup)
    assert result.ok, result.to_dict()


@pytest.mark.parametrize("source", ["mixture", "val_file"])
def test_a_trainer_continued_from_its_state_draws_the_same_windows(source, request):
    """What --resume relies on: a mixture's windows, epoch windows and a validation file give the same losses and
    held-out loss."""
    if source == "mixture":
        data = dict(data=default_text(), data_mix=request.getfixturevalue("mixture"), sampling="epoch")
    else:
        data = dict(sampling="epoch", val_data=request.getfixturevalue("val_file"), val_fraction=0.0)
    setup = local_setup([(1, [16, 16])], stages=2, steps=4, **data)
    layout, schedule = Layout(1, 2, 1), Schedule.of_plan(setup.plan)

    def trainer(world, rank):
        return Trainer(
            setup.plan, schedule, setup.args, layout=layout, rank=rank, device=torch.device("cpu"),
            comms=local_comms(world, layout, rank), data=setup.data, held_out=setup.held_out,
        )  # fmt: skip

    def four_steps(rank, world):
        t = trainer(world, rank)
        return [t.step(s).loss for s in range(1, 5)] + [t.evaluate()]

    world = LocalWorld(layout.world)
    straight = world.run(lambda rank: four_steps(rank, world))

    first_two, _, last_two, held_out = continued_in_new_trainers(trainer, layout.world, Trainer.evaluate)[0]
    assert first_two + last_two + [held_out] == pytest.approx(straight[0], rel=1e-6)
    t = trainer(LocalWorld(layout.world), 0)
    assert t.consumed(4) == (4 * 32, pytest.approx(epochs_done(setup.data, step=4, sequences=1, seq_len=32)))
