"""ZB-H1 trained through the workers' own code (the in-process executor, tests/conftest.py `verify_locally`): I's
and W's walked by the executor, the gradient sent after I, the same losses, gradients and weights as the
single-device reference — both architectures, unequal token slices and two batch slices sliced differently,
recomputation, T = 2, bf16, v = 2 — and negative controls that must fail. (Under NCCL's message rules:
tests/engine/test_cuda_branches.py.)"""

import pytest
from conftest import local_setup, verify_locally

from terapipe_cli.config.model import ModelConfig
from terapipe_cli.engine.stage import StageRunner
from terapipe_cli.plan.schedule import Schedule, parse_schedule


def llama(layers: int = 6) -> ModelConfig:
    return ModelConfig(name="test-llama", layers=layers, hidden=32, heads=4, vocab=256, seq_len=32, arch="llama")


ZB = {"order": "zb1p"}
ZBV = {"order": "zbv", "virtual_stages": 2}
CASES = {
    "K=2, unequal token slices": ([(2, [13, 1, 11, 7])], 2, {}, ZB),
    "K=3, two batch slices sliced differently, recomputed on some stages": (
        [(1, [20, 12]), (1, [5, 5, 22])],
        3,
        {},
        {**ZB, "recompute": [True, False, True]},
    ),
    "K=2, T=2, bf16": ([(1, [8, 24])] * 3, 2, {"tensor_parallel": 2, "precision": "bf16"}, ZB),
    "K=2, v=2, batch slices of different sizes": (
        [(2, [16, 16]), (1, [8, 8, 16]), (1, [32])],
        2,
        {},
        {**ZB, "virtual_stages": 2, "layers_per_stage": [1, 2, 2, 1]},
    ),
    "llama, K=2, recomputed, bf16": (
        [(1, [20, 12]), (1, [5, 5, 22])],
        2,
        {"precision": "bf16"},
        {**ZB, "recompute": [True, True]},
    ),
    "llama, K=3, T=2": ([(2, [13, 1, 11, 7])], 3, {"tensor_parallel": 2}, ZB),
    # ZB-V: chunks k and 2K − 1 − k on device k; the V's bottom hands over in memory, the up arm sends back down.
    "ZB-V, K=2, unequal token slices": ([(2, [13, 1, 11, 7])], 2, {}, {**ZBV, "recompute": [False] * 4}),
    "ZB-V, K=3, two batch slices sliced differently, recomputed on some chunks, bf16": (
        [(1, [20, 12]), (1, [5, 5, 22])],
        3,
        {"precision": "bf16"},
        {**ZBV, "recompute": [True, False, False, True, False, True]},
    ),
    "llama, ZB-V, K=3, T=2": ([(1, [8, 24])] * 3, 3, {"tensor_parallel": 2}, {**ZBV, "recompute": [False] * 6}),
}


def setup_of(name: str, **changes):
    slices, stages, args, fields = CASES[name]
    model = llama() if name.startswith("llama") else None
    extra = {"model": model} if model is not None else {}
    return local_setup(slices, stages=stages, plan_fields=fields, **extra, **{**args, **changes})


@pytest.mark.parametrize("name", list(CASES))
def test_zero_bubble_verifies(name):
    setup = setup_of(name)
    assert setup.plan.partition.placement == ("v" if "ZB-V" in name else "interleaved")
    result, run = verify_locally(setup)
    assert result.ok, [(c.what, c.max_rel, c.tolerance) for c in result.checks]


def test_dropping_the_kv_handback_fails_zb1p():
    result, _ = verify_locally(setup_of("K=2, unequal token slices", kv_handback=False))
    assert not result.ok


def test_skipping_one_tiles_w_fails(monkeypatch):
    original = StageRunner.backward_weight

    def skip_one(self, batch_slice, token_slice, *, chunk=None):
        if (batch_slice, token_slice) == (0, 1) and self.first:
            self._weights.pop((self._chunk(chunk), batch_slice, token_slice))  # its weights' gradient lost
            state = self._slices[(self._chunk(chunk), batch_slice)]
            state.weights_due -= 1
            self._backward_end((self._chunk(chunk), batch_slice, token_slice), state, popped=True)
            return
        original(self, batch_slice, token_slice, chunk=chunk)

    monkeypatch.setattr(StageRunner, "backward_weight", skip_one)
    result, _ = verify_locally(setup_of("K=2, unequal token slices"))
    assert not result.ok


def test_a_torch_format_csv_with_i_and_w_trains_the_same_order():
    """A schedule in torch.distributed.pipelining's CSV form (``0F0,0I0,0W0,…``: whole sequences) read by
    `parse_schedule`, as `terapipe train --schedule` reads it, trains ZB-H1's order and verifies."""
    setup = local_setup([(1, [32])] * 3, stages=2, plan_fields=ZB)
    built = Schedule.of_plan(setup.plan)
    text = built.to_csv()
    assert text.startswith("0F0,0F1,0I0,0W0,0F2,") and "1W0" in text
    schedule = parse_schedule(text, setup.plan.slices, 2, setup.plan.recompute)
    assert schedule.actions == built.actions
    result, run = verify_locally(setup, schedule)
    assert result.ok
