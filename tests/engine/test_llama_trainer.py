"""The llama architecture through the runtime (models/llama/): every scheme family of tests/engine/test_trainer.py
verifies against single-device training, one process with every rank a thread, on a grouped-query model (2 key/value
heads for 4 query heads); bf16 too; a trainer continued from its state takes the same steps; RoPE at slice-local
positions and a dropped K/V hand-back fail the same check."""

from __future__ import annotations

import pytest
import torch
from conftest import TWO_STEPS, local_setup, train_locally, verify_local_run, verify_locally
from local_world import continued_in_new_trainers, local_comms
from test_trainer import FAMILIES

from terapipe_cli.engine.mesh import Layout
from terapipe_cli.engine.trainer import Trainer
from terapipe_cli.models import LlamaConfig, ModelConfig
from terapipe_cli.schedule.schedule import Schedule


def llama_model(layers: int = 6, **fields) -> ModelConfig:
    """6 layers (the families' partitions), H = 32, 4 query heads and 2 key/value heads of 8 features, SwiGLU 64."""
    base = dict(name="test-llama", layers=layers, hidden=32, heads=4, vocab=256, seq_len=32)
    return LlamaConfig(**{**base, "kv_heads": 2, "ffn_hidden": 64, **fields})


def llama_setup(name: str, **changes):
    """The family ``name`` on `llama_model`, two steps (conftest.TWO_STEPS) unless ``changes`` say."""
    slices, stages, args, fields = FAMILIES[name]
    args = {**TWO_STEPS, **args, **changes}
    return local_setup(slices, stages=stages, model=llama_model(args.pop("layers", 6)), plan_fields=fields, **args)


def checks(result):
    return [(c.what, c.max_rel, c.tolerance) for c in result.checks]


# The families that change what a Llama layer computes or holds: where the token slices cut the rotary positions,
# batch slices of other sizes, the grouped-query heads and the vocabulary split over tensor ranks, recomputation,
# the untied head and the final norm on a stage of their own, chunks of layers. The others vary only the order of
# the same tiles, which the executor walks alike for every architecture (all of them verify for GPT, test_trainer.py).
ARCHITECTURE_FAMILIES = [
    "K=2", "uneven token slices", "a different token slicing per batch slice", "batch slices of different sizes",
    "T=2, K=1", "T=2, K=2, D=2", "recomputed", "embedding and head alone on their stages",
    "2 virtual stages, recomputed on some chunks", "2 virtual stages, T=2",
]  # fmt: skip


@pytest.mark.parametrize("name", ARCHITECTURE_FAMILIES)
def test_the_scheme_families_that_touch_the_layer_verify_for_llama(name):
    result, run = verify_locally(llama_setup(name))
    assert result.ok, checks(result)
    assert len(run.losses) == 2 and run.grads_step == 1


@pytest.mark.parametrize(
    "name",
    ["K=3", "a different token slicing per batch slice", "T=2, K=2", "recomputed", "2 virtual stages, T=2"],
)
def test_llama_in_bf16_verifies_within_the_measured_spread(name):
    result, _ = verify_locally(llama_setup(name, precision="bf16"))
    assert result.ok and result.precision == "bf16", checks(result)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_rope_at_slice_local_positions_fails_verification(precision):
    """Negative control: every slice of the pipelined run rotating its queries and keys as if it began the sequence
    (the reference and the spread runs, after it, rotate by the absolute positions): it must fail."""
    setup = llama_setup("K=2", precision=precision)
    run = train_locally(llama_setup("K=2", precision=precision, rope_absolute=False))
    result = verify_local_run(run, setup)
    assert not result.ok
    grads = next(c for c in result.checks if c.what.startswith("gradients"))
    assert grads.max_rel > 10 * grads.tolerance, checks(result)


def test_dropping_the_kv_handback_fails_verification_for_llama():
    result, _ = verify_locally(llama_setup("K=2", kv_handback=False))
    assert not result.ok
    grads = next(c for c in result.checks if c.what.startswith("gradients"))
    assert grads.max_rel > 10 * grads.tolerance


@pytest.mark.parametrize("args", [{}, {"tensor_parallel": 2}], ids=["T=1", "T=2"])
def test_a_llama_trainer_continued_from_its_state_takes_the_same_steps(args):
    """What --resume relies on, for llama: two steps, the stages' whole state into new trainers, two more steps."""
    setup = local_setup([(1, [16, 16])], stages=2, steps=4, model=llama_model(), **args)
    whole = train_locally(setup).losses
    layout = Layout(1, 2, setup.args.tensor_parallel)
    schedule = Schedule.of_plan(setup.plan)

    def trainer(world, rank):
        return Trainer(
            setup.plan, schedule, setup.args, layout=layout, rank=rank, device=torch.device("cpu"),
            comms=local_comms(world, layout, rank), data=setup.data, held_out=setup.held_out,
        )  # fmt: skip

    first_two, (model, _), last_two, _ = continued_in_new_trainers(trainer, layout.world)[0]
    assert first_two + last_two == pytest.approx(whole, rel=1e-6)
    # stage 0, tensor rank 0: whole tensors, whatever T
    assert model["blocks.0.attn.k_proj.weight"].shape == (2 * 8, 32)
