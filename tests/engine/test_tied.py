"""Tied embeddings across stages (docs/design.md §6c, Megatron-LM's embedding group): the first and the last stage
each hold the tied matrix, their gradients are summed every step, both copies take the same update and stay
bit-identical, and the run equals single-device training with one matrix (its gradient the sum of the two uses) —
for llama and GPT-2, at K = 1 (one matrix, two chunks on one device), K = 3, K = 2 with T = 2 (the vocabulary
split), interleaved chunks and D = 2, with clipping by the global norm active (the tied matrix counted once: counted
twice, the norm and so every update would differ). Without the gradient sum (the negative control) the same check
fails."""

from __future__ import annotations

import pytest
import torch
from conftest import TWO_STEPS, local_setup, verify_locally
from test_gpt2_trainer import gpt2_model
from test_llama_trainer import llama_model

from terapipe_cli.engine.trainer import Trainer

MODELS = {"llama": lambda: llama_model(tie_embeddings=True), "gpt2": lambda: gpt2_model(tie_embeddings=True)}
LAYOUTS = {
    "K=1, two chunks": ([(1, [12, 20])], 1, {}, {"virtual_stages": 2, "layers_per_stage": [3, 3]}),
    "K=3": ([(1, [16, 8, 8])] * 2, 3, {}, {}),
    "K=2, T=2": ([(1, [8, 24])] * 2, 2, {"tensor_parallel": 2}, {}),
    "K=2, 2 virtual stages, 1F1B": (
        [(2, [16, 16]), (1, [8, 8, 16])], 2, {},
        {"virtual_stages": 2, "layers_per_stage": [1, 2, 2, 1], "order": "1f1b"},
    ),
    "K=2, D=2": ([(1, [12, 20])], 2, {"data_parallel": 2}, {}),
}  # fmt: skip


def _checks(result):
    return [(c.what, c.max_rel, c.tolerance) for c in result.checks]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", list(MODELS))
def test_tied_embeddings_verify_in_every_layout(arch, layout):
    slices, stages, args, fields = LAYOUTS[layout]
    setup = local_setup(slices, stages=stages, model=MODELS[arch](), plan_fields=fields, **TWO_STEPS, **args)
    result, run = verify_locally(setup)
    assert result.ok, _checks(result)
    assert torch.equal(run.weights["wte.weight"], run.weights["lm_head.weight"])  # the copies, bit-identical


def test_bf16_tied_embeddings_across_stages_verify():
    setup = local_setup([(1, [16, 8, 8])] * 2, stages=3, model=MODELS["llama"](), precision="bf16")
    result, _ = verify_locally(setup)
    assert result.ok, _checks(result)


@pytest.mark.parametrize("layout", ["K=3", "K=2, T=2"])
def test_without_the_gradient_sum_the_copies_drift_and_verification_fails(monkeypatch, layout):
    """Negative control: each copy steps on its own half of the gradient."""
    monkeypatch.setattr(Trainer, "sum_tied_gradients", lambda self: None)
    slices, stages, args, fields = LAYOUTS[layout]
    result, run = verify_locally(
        local_setup(slices, stages=stages, model=MODELS["llama"](), plan_fields=fields, **TWO_STEPS, **args)
    )
    assert not result.ok
    grads = next(c for c in result.checks if c.what.startswith("gradients"))
    assert grads.max_rel > 10 * grads.tolerance
    assert not torch.equal(run.weights["wte.weight"], run.weights["lm_head.weight"])


@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_the_plan_counts_both_copies_and_the_gradient_sum(tensor_parallel):
    """The planner side: across stages the last device holds a copy of the tied matrix (its memory and its update)
    and every step sums the two copies' gradients over the stage link; on one device there is one matrix."""
    from dataclasses import replace

    from terapipe_cli.config.hardware import load_hardware
    from terapipe_cli.config.model import load_model_config
    from terapipe_cli.models import vocab_share
    from terapipe_cli.plan.costmodel import CostModel, profile_from_dict
    from terapipe_cli.plan.memory import stage_sizes
    from terapipe_cli.profile.analytic import analytic_profile

    untied = load_model_config("llama-tiny")
    tied = replace(untied, tie_embeddings=True)
    hardware = load_hardware("h100")

    def profile(model):
        raw = analytic_profile(model, hardware, tensor_parallel=tensor_parallel, batch_sizes=(1, 2))
        return profile_from_dict(raw, "analytic")

    matrix = vocab_share(tied.vocab, tensor_parallel) * tied.hidden
    state = 16.0  # bytes of fp32 weight, gradient and Adam's two moments per parameter (memory.py)
    for stages in (1, 2):
        a, b = stage_sizes(profile(tied), stages), stage_sizes(profile(untied), stages)
        assert a[-1].state == b[-1].state - (matrix * state if stages == 1 else 0)  # one matrix, or the copy
        cost = CostModel(profile(tied), stages)
        assert (cost.tied_allreduce_s > 0) == (stages > 1)
        assert cost.step_s >= cost.tied_allreduce_s
