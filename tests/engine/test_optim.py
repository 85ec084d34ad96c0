"""The optimizer step's policies (engine/optim.py): lr schedule, global-norm clipping, fp16 loss scale."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_model

from terapipe_cli.config.optimizer import OptimizerConfig
from terapipe_cli.config.run import LRSchedule, RunArguments
from terapipe_cli.engine.optim import LossScale, clip_global_norm, make_optimizer, take_step
from terapipe_cli.errors import UserError
from terapipe_cli.models import LlamaConfig, build_model


def test_warmup_is_linear_up_to_the_peak():
    s = LRSchedule(lr=1e-3, total_steps=100, warmup_steps=10, min_lr=1e-4)
    assert [s(k) for k in range(1, 11)] == pytest.approx([1e-4 * k for k in range(1, 11)])


def test_cosine_decay_reaches_min_lr_at_the_last_step_and_stays_there():
    s = LRSchedule(lr=1e-3, total_steps=100, warmup_steps=10, min_lr=1e-4)
    decay = [s(k) for k in range(10, 101)]
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False))  # strictly falling from the peak
    assert s(55) == pytest.approx((1e-3 + 1e-4) / 2)  # half-way through the decay: half-way down
    assert s(100) == pytest.approx(1e-4)
    assert s(101) == s(500) == 1e-4  # a run extended by --resume keeps the floor


def test_defaults_and_their_errors():
    s = LRSchedule.default(1e-3, 50)
    assert (s.warmup_steps, s.min_lr) == (5, pytest.approx(1e-4))
    assert LRSchedule.default(1e-3, 3).warmup_steps == 1  # at least one step
    assert LRSchedule.default(1e-3, 10).warmup_steps == 3  # at least three once the run has 9 steps
    assert LRSchedule.default(1e-3, 7).warmup_steps == 2  # a third of a shorter run
    for kwargs, field in [  # the library names the setting; the command line maps it to its flag
        ({"lr": 0.0, "total_steps": 10}, "lr"),
        ({"lr": 1e-3, "total_steps": 10, "warmup_steps": -1}, "warmup_steps"),
        ({"lr": 1e-3, "total_steps": 10, "min_lr": 2e-3}, "min_lr"),
    ]:
        with pytest.raises(UserError) as e:
            LRSchedule.default(**kwargs)
        assert e.value.where == field


def test_schedule_of_a_run_and_of_a_run_from_before_the_schedule():
    base = dict(steps=20, data=None, seed=0, lr=1e-3, data_parallel=1, checkpoint_every=5, threads=1)
    args = RunArguments(**base, timeout_s=9.0, verify=False, warmup_steps=2, min_lr=1e-4, decay_steps=10)
    s = LRSchedule.of_run(args)
    assert (s.total_steps, s.warmup_steps, s(10), s(20)) == (10, 2, pytest.approx(1e-4), pytest.approx(1e-4))
    old = LRSchedule.of_run(RunArguments(**base, timeout_s=9.0, verify=False))
    assert {old(k) for k in range(1, 21)} == {1e-3}  # constant, as such runs were trained


def _params(*grads: list[float]) -> list[torch.nn.Parameter]:
    out = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(len(g)))
        p.grad = torch.tensor(g)
        out.append(p)
    return out


def test_global_norm_clips_every_stage_by_the_same_factor():
    """Acceptance: a run whose largest gradient sits on the last stage clips every stage — also the first,
    whose own gradient is within the limit."""
    stage0, stage1 = _params([0.3, 0.4]), _params([6.0, 8.0])  # local norms 0.5 and 10
    global_norm = math.sqrt(0.5**2 + 10**2)
    squares = {0: 0.5**2, 1: 10.0**2}

    def sum_across(me: int):
        other = 1 - me
        return lambda t: t.add_(squares[other])  # what the all-reduce over the two stages adds

    assert clip_global_norm(stage0, 1.0, sum_across(0)) == pytest.approx(global_norm)
    assert clip_global_norm(stage1, 1.0, sum_across(1)) == pytest.approx(global_norm)
    factor = 1.0 / global_norm
    assert stage0[0].grad.tolist() == pytest.approx([0.3 * factor, 0.4 * factor], rel=1e-5)
    assert stage1[0].grad.tolist() == pytest.approx([6.0 * factor, 8.0 * factor], rel=1e-5)
    # The same as clipping the whole model on one device ...
    whole = _params([0.3, 0.4], [6.0, 8.0])
    clip_global_norm(whole, 1.0)
    assert torch.cat([stage0[0].grad, stage1[0].grad]).tolist() == pytest.approx(
        torch.cat([p.grad for p in whole]).tolist(), rel=1e-6
    )
    # ... and not what clipping each stage by its own norm does: stage 0 (norm 0.5 < 1) would stay unscaled.
    alone = _params([0.3, 0.4])
    assert clip_global_norm(alone, 1.0) == pytest.approx(0.5)
    assert alone[0].grad.tolist() == pytest.approx([0.3, 0.4])


def test_grad_clip_zero_measures_without_clipping():
    params = _params([3.0, 4.0])
    assert clip_global_norm(params, 0.0) == pytest.approx(5.0)
    assert params[0].grad.tolist() == [3.0, 4.0]


def test_loss_scale_halves_on_overflow_and_grows_after_clean_steps():
    s = LossScale(growth_interval=3)
    assert s.scale == 2.0**16
    s.update(True)
    assert (s.scale, s.clean_steps) == (2.0**15, 0)
    for _ in range(2):
        s.update(False)
    assert s.scale == 2.0**15
    s.update(False)
    assert (s.scale, s.clean_steps) == (2.0**16, 0)
    s.update(False)
    restored = LossScale()
    restored.load_state_dict(s.state_dict())
    assert (restored.scale, restored.clean_steps) == (2.0**16, 1)


def _model_with_grads(scale: float, bad: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 3, bias=True)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.01 * scale)
    if bad:
        model.weight.grad[0, 0] = float("inf")
    return model, make_optimizer(model, 1e-3)


def test_take_step_unscales_clips_and_steps():
    model, opt = _model_with_grads(scale=1024.0)
    before = [p.detach().clone() for p in model.parameters()]
    out = take_step(opt, list(model.parameters()), max_norm=1.0, loss_scale=LossScale(scale=1024.0))
    assert not out.skipped and out.loss_scale == 1024.0
    assert out.grad_norm == pytest.approx(0.01 * math.sqrt(15), rel=1e-5)  # the unscaled norm, not clipped
    assert all(p.grad.eq(0.01).all() for p in model.parameters())
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_an_overflow_on_any_rank_skips_the_step_everywhere():
    for local_bad, elsewhere in [(True, False), (False, True)]:

        def overflow_anywhere(overflow: bool, elsewhere: bool = elsewhere) -> bool:
            return overflow or elsewhere  # the MAX all-reduce over all ranks

        model, opt = _model_with_grads(scale=1.0, bad=local_bad)
        before = [p.detach().clone() for p in model.parameters()]
        scale = LossScale(scale=8.0)
        out = take_step(
            opt,
            list(model.parameters()),
            max_norm=1.0,
            loss_scale=scale,
            overflow_anywhere=overflow_anywhere,
        )
        assert out.skipped and out.grad_norm is None and out.loss_scale == 4.0 == scale.scale
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        assert not opt.state  # AdamW has not counted a step either


def _groups(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> dict[str, float]:
    """Each parameter's name -> the weight decay of its group."""
    names = {id(p): n for n, p in module.named_parameters()}
    return {names[id(p)]: g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}


def test_the_optimizer_takes_its_config_whole():
    """AdamW's weight decay, betas and eps as `OptimizerConfig` says; the defaults are nanoGPT's: 0.1 on every
    matrix, the embeddings and the head included, none on norms and biases."""
    model = build_model(tiny_model(layers=2))
    default = make_optimizer(model, 1e-3)
    decay = _groups(default, model)
    assert {n for n, wd in decay.items() if wd == 0.1} == {n for n, p in model.named_parameters() if p.dim() >= 2}
    assert {"wte.weight", "wpe.weight", "lm_head.weight"} <= {n for n, wd in decay.items() if wd == 0.1}
    assert all(wd == 0.0 for n, wd in decay.items() if "ln" in n)
    assert [(g["betas"], g["eps"]) for g in default.param_groups] == [((0.9, 0.95), 1e-8)] * 2
    config = OptimizerConfig(weight_decay=0.3, beta1=0.8, beta2=0.99, eps=1e-6)
    custom = make_optimizer(model, 1e-3, config)
    assert [(g["weight_decay"], g["betas"], g["eps"]) for g in custom.param_groups] == [
        (0.3, (0.8, 0.99), 1e-6),
        (0.0, (0.8, 0.99), 1e-6),
    ]


@pytest.mark.parametrize("tied", [False, True])
def test_no_decay_embeddings_leaves_the_embeddings_and_the_head_undecayed(tied):
    """``decay_embeddings=False``: the token and position embeddings and the LM head join the norms and biases
    (tied: the one matrix); every other matrix keeps its decay."""
    cfg = (
        LlamaConfig(name="t", layers=2, hidden=32, heads=4, vocab=256, seq_len=32, tie_embeddings=True)
        if tied
        else tiny_model(layers=2)
    )
    model = build_model(cfg)
    decay = _groups(make_optimizer(model, 1e-3, OptimizerConfig(decay_embeddings=False)), model)
    embeddings = {"wte.weight"} if tied else {"wte.weight", "wpe.weight", "lm_head.weight"}
    assert len(decay) == len(list(model.parameters())) and all(decay[n] == 0.0 for n in embeddings)
    assert all(decay[n] == 0.1 for n, p in model.named_parameters() if p.dim() >= 2 and n not in embeddings)
    assert any(decay[n] == 0.1 for n in decay)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("weight_decay", -0.1, "at least 0"),
        ("beta1", 1.0, "[0, 1)"),
        ("beta2", -0.5, "[0, 1)"),
        ("eps", 0.0, "positive"),
        ("weight_decay", float("inf"), "finite"),
        ("beta1", float("nan"), "[0, 1)"),
    ],
)
def test_a_bad_optimizer_setting_is_a_value_error_naming_it(field, value, words):
    with pytest.raises(ValueError, match=field) as e:
        OptimizerConfig(**{field: value})
    assert isinstance(e.value, UserError) and words in str(e.value)


@pytest.mark.parametrize("kernel", ["foreach", "fused"])
def test_the_runtimes_adamw_is_torchs_and_their_checkpoints_load_in_each_other(kernel):
    """`optim.AdamW` (which never loads torch's compiler) against torch.optim.AdamW with the same groups and settings:
    the same weights after steps whose learning rate changes, the same state dict (tensors, types, devices, groups),
    and each one's state dict loaded by the other trains on alike."""
    import copy

    from terapipe_cli.engine.optim import AdamW

    torch.manual_seed(0)
    ours_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    torchs_model = copy.deepcopy(ours_model)

    def groups(model):
        ps = list(model.parameters())
        return [
            {"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0},
        ]

    settings = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
    ours = AdamW(groups(ours_model), **settings, foreach=kernel == "foreach", fused=kernel == "fused")
    torchs = torch.optim.AdamW(groups(torchs_model), **settings, **{kernel: True})

    def steps(pairs, n):
        for step in range(n):
            x = torch.randn(3, 8)
            for model, optimizer in pairs:
                optimizer.zero_grad(set_to_none=True)
                model(x).pow(2).sum().backward()
                for g in optimizer.param_groups:
                    g["lr"] = 1e-2 * (step + 1)
                optimizer.step()
        for a, b in zip(ours_model.parameters(), torchs_model.parameters(), strict=True):
            assert torch.equal(a, b)

    steps([(ours_model, ours), (torchs_model, torchs)], 4)
    mine, theirs = ours.state_dict(), torchs.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    assert mine["state"].keys() == theirs["state"].keys()
    for i, state in theirs["state"].items():
        for key, value in state.items():
            got = mine["state"][i][key]
            assert torch.equal(got, value) and (got.dtype, got.device) == (value.dtype, value.device), (i, key)
    ours_again = AdamW(groups(ours_model), **settings, foreach=True, fused=False)
    ours_again.load_state_dict(theirs)
    torchs_again = torch.optim.AdamW(groups(torchs_model), **settings)
    torchs_again.load_state_dict(mine)
    steps([(ours_model, ours_again), (torchs_model, torchs_again)], 2)
