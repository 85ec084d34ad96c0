"""StageRunner, one stage's tile path: what it keeps for the backward, the profiler's middle stage, the order it
insists on. (Its gradients over whole schedules, every family: engine/test_trainer.py, through the executor.)"""

import pytest
import torch
from conftest import tiny_model

from terapipe_cli.engine.stage import StageRunner


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


@pytest.mark.parametrize("stage", [0, 1])
def test_a_tile_dropped_by_reset_frees_its_graph(stage):
    """A tile run forward and never backward (the profiler's untimed tile, an abandoned step) is freed by `reset`:
    no tensor of its graph stays alive (found: the saved-tensor hook once returned each saved tensor as itself,
    so a saved output held its own grad_fn — a cycle through autograd's C++ graph that Python's collector cannot
    see — and every dropped tile of the last stage leaked its logits)."""
    import gc

    cfg = tiny_model(layers=2, seq_len=64)
    r = StageRunner(cfg, stage, 2)
    tokens = torch.randint(0, cfg.vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    x = tokens if stage == 0 else torch.randn(2, 32, cfg.hidden)

    def alive_after_a_dropped_tile() -> int:
        r.forward_tile(0, 0, x, tokens)
        r.reset()
        gc.collect()
        return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))

    alive_after_a_dropped_tile()
    first = alive_after_a_dropped_tile()
    assert alive_after_a_dropped_tile() == first  # a leak keeps the tile's tensors: one more tile, more alive
