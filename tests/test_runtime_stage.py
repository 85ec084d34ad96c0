"""StageRunner's tile path, with the stages chained in one process: gradients must equal the whole model's."""

from contextlib import ExitStack

import pytest
import torch
from conftest import tiny_model

from terapipe_cli.engine.model import GPT, token_loss_sum
from terapipe_cli.engine.stage import StageRunner
from terapipe_cli.plan.schedule import Schedule


def reference_grads(cfg, tokens, targets, seed, autocast_dtype=None):
    """The whole model on the whole batch; under autocast of ``autocast_dtype`` when given."""
    model = GPT(cfg, seed=seed)
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        logits = model(tokens)
        loss = token_loss_sum(logits, targets) / targets.numel()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def pipelined_grads(cfg, tokens, targets, slices, stages, seed, kv_handback=True, precision="fp32", recompute=False):
    """Walk the schedule stage by stage (stage k's forward tiles feed stage k+1), as the workers would."""
    runners = [
        StageRunner(cfg, k, stages, seed=seed, kv_handback=kv_handback, precision=precision, recompute=recompute)
        for k in range(stages)
    ]
    with ExitStack() as step:
        for r in runners:
            r.set_loss_scale(1.0 / targets.numel())
            step.enter_context(r.step())
        return _walk(runners, tokens, targets, slices, stages)


def _walk(runners, tokens, targets, slices, stages):
    schedule = Schedule.build(slices, stages)
    acts = {}
    loss = 0.0
    for k, r in enumerate(runners):
        for a in schedule[k]:
            t = a.tile
            if a.phase != "F":
                continue
            rows = slice(t.batch_start, t.batch_start + t.batch_size)
            cols = slice(t.token_start, t.token_start + t.tokens)
            x = tokens[rows, cols] if k == 0 else acts[(k - 1, t)]
            out = r.forward_tile(t.batch_slice, t.token_slice, x, targets[rows, cols] if r.last else None)
            if r.last:
                loss += out.item()
            else:
                acts[(k, t)] = out
    grads = {}
    for k in reversed(range(stages)):
        r = runners[k]
        for a in schedule[k]:
            if a.phase == "B":
                g = r.backward_tile(a.tile.batch_slice, a.tile.token_slice, None if r.last else grads[(k + 1, a.tile)])
                grads[(k, a.tile)] = g
        assert r.pending_tiles == 0
    named = {}
    for r in runners:
        named.update({n: p.grad for n, p in r.module.named_parameters()})
    return loss / targets.numel(), named


SCHEMES = {
    "uniform": [(2, [8, 8, 8, 8])],
    "uneven": [(2, [13, 1, 11, 7])],
    "per-batch-slice": [(1, [20, 12]), (1, [5, 5, 22])],
    "batch-slices-of-different-sizes": [(2, [16, 16]), (1, [32])],
    "gpipe": [(1, [32])] * 3,
}


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_tiles_give_the_single_device_gradient(name, stages, recompute):
    """Also with every tile recomputed in its backward: the re-run writes the same K/V rows, the hand-back is
    the same, so the gradient is too."""
    cfg = tiny_model(seq_len=32)
    slices = SCHEMES[name]
    batch = sum(b for b, _ in slices)
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, cfg.vocab, (batch, 33), generator=g)
    tokens, targets = data[:, :-1], data[:, 1:]
    ref_loss, ref = reference_grads(cfg, tokens, targets, seed=5)
    loss, got = pipelined_grads(cfg, tokens, targets, slices, stages, seed=5, recompute=recompute)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert set(got) == set(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-4, atol=1e-6, msg=n)


def test_without_kv_handback_gradients_differ():
    """Negative control: dropping the earlier slices' K/V gradients must change the gradient."""
    cfg = tiny_model(seq_len=32)
    data = torch.randint(0, cfg.vocab, (2, 33), generator=torch.Generator().manual_seed(7))
    tokens, targets = data[:, :-1], data[:, 1:]
    _, ref = reference_grads(cfg, tokens, targets, seed=5)
    _, got = pipelined_grads(cfg, tokens, targets, [(2, [8, 8, 16])], 2, seed=5, kv_handback=False)
    worst = max(((got[n] - ref[n]).abs().max() / ref[n].abs().max()).item() for n in ref)
    assert worst > 1e-2


def _relative(got, ref):
    """The largest norm-wise relative difference over the parameters."""
    return max(((got[n] - ref[n]).norm() / ref[n].norm()).item() for n in ref)


def test_bf16_tiles_are_within_the_measured_bf16_spread():
    """bf16 tiles against the whole model under the same bf16 autocast. Tile shapes change the summation order,
    so the tolerance is measured: twice the distance between the whole model in bf16 and in fp32 (about 1e-2
    here; the tiles land at about 6e-3). Dropping the K/V hand-back (about 1.0) must still fail it."""
    cfg = tiny_model(seq_len=32)
    data = torch.randint(0, cfg.vocab, (2, 33), generator=torch.Generator().manual_seed(7))
    tokens, targets = data[:, :-1], data[:, 1:]
    _, ref16 = reference_grads(cfg, tokens, targets, seed=5, autocast_dtype=torch.bfloat16)
    _, ref32 = reference_grads(cfg, tokens, targets, seed=5)
    tolerance = 2 * _relative(ref16, ref32)
    slices = [(2, [8, 8, 16])]
    _, got = pipelined_grads(cfg, tokens, targets, slices, 2, seed=5, precision="bf16")
    assert _relative(got, ref16) <= tolerance
    _, broken = pipelined_grads(cfg, tokens, targets, slices, 2, seed=5, precision="bf16", kv_handback=False)
    assert _relative(broken, ref16) > 10 * tolerance


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_slicing_keeps_no_more_saved_tensors_than_the_whole_sequence(precision):
    """K/V written once into the cache, one low-precision copy of each weight per step, masks shared: 8 slices
    keep within 10% of the bytes the whole sequence keeps for its backward (counted from autograd's saved
    tensors, each storage once)."""
    cfg = tiny_model(seq_len=256)
    data = torch.randint(0, cfg.vocab, (1, 257), generator=torch.Generator().manual_seed(0))

    def saved_bytes(slices):
        runner = StageRunner(cfg, 0, 1, precision=precision)
        params = {p.untyped_storage().data_ptr() for p in runner.module.parameters()}
        storages = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        start = 0
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), runner.step():
            for n, i in enumerate(slices):
                runner.forward_tile(0, n, data[:, start : start + i], data[:, start + 1 : start + i + 1])
                start += i
        return sum(storages.values())

    assert saved_bytes([32] * 8) <= 1.10 * saved_bytes([256])


def test_middle_stage_runs_random_activations():
    """What the profiler times: a middle stage with one layer, fed random (b, i, H)."""
    cfg = tiny_model(layers=3, seq_len=32)
    r = StageRunner(cfg, 1, 3)
    assert r.module.layer_ids == [1]
    x0 = torch.randn(2, 10, cfg.hidden)
    x1 = torch.randn(2, 6, cfg.hidden)
    assert r.forward_tile(0, 0, x0).shape == (2, 10, cfg.hidden)
    assert r.forward_tile(0, 1, x1).shape == (2, 6, cfg.hidden)
    assert r.backward_tile(0, 1, torch.randn(2, 6, cfg.hidden)).shape == (2, 6, cfg.hidden)
    assert r.backward_tile(0, 0, torch.randn(2, 10, cfg.hidden)).shape == (2, 10, cfg.hidden)
    r.forward_tile(0, 0, x0)
    r.reset()
    assert r.pending_tiles == 0
    r.forward_tile(0, 0, x0)  # a reset runner starts again at token slice 0


def test_out_of_order_tiles_are_refused():
    cfg = tiny_model(layers=2, seq_len=32)
    r = StageRunner(cfg, 1, 2)
    with pytest.raises(RuntimeError, match="in order"):
        r.forward_tile(0, 1, torch.randint(0, 256, (1, 4)))
