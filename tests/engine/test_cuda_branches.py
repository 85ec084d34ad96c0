"""The arithmetic of every branch the runtime takes only on CUDA, run on the CPU and compared with the branch the CPU
takes, so a GPU run has kernels and speed left to check, not arithmetic (docs/status.md, "On a GPU"):

- attention over a slice's K/V cache through ``causal_lower_right`` (the fused kernels' bottom-right causal
  alignment) instead of the CPU's reversed additive mask, in fp32 and under bf16/fp16 autocast, with multi-head and
  grouped-query attention (and fp32 CUDA's expansion of the grouped key/value heads);
- the fused AdamW kernel the CUDA optimizer takes instead of the multi-tensor one;
- NCCL's pairing of messages (tags ignored, the n-th send meeting the n-th receive, the messages between two ranks
  in issue order on one stream per process group), which no CPU process group has: `local_world`'s NCCL rules run
  the workers' own executor under them, for every schedule order, interleaved chunks, D and T;
- the host-memory copies of stages that share a GPU (gloo), forced on the CPU between two real processes.

Each has a negative control that breaks the forced branch and must fail the same comparison.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import TWO_STEPS, local_setup, verify_locally

from terapipe_cli.engine.executor import _StepWalk
from terapipe_cli.engine.optim import make_optimizer
from terapipe_cli.models import attention
from terapipe_cli.models.attention import KVCache, attend, forced_branch
from terapipe_cli.schedule.schedule import parse_schedule

LOW = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _sliced_attention(branch: str | None, precision: str, heads: int, kv_heads: int) -> list[torch.Tensor]:
    """Three token slices (5, 7, 4 tokens) attending through one K/V cache, then one backward in reverse order:
    the outputs and the gradients of every slice's q, k and v. ``branch``: forced (None: the CPU's own)."""
    g = torch.Generator().manual_seed(0)
    lengths, b, d = (5, 7, 4), 2, 8
    q = [torch.randn(b, heads, i, d, generator=g).requires_grad_() for i in lengths]
    k = [torch.randn(b, kv_heads, i, d, generator=g).requires_grad_() for i in lengths]
    v = [torch.randn(b, kv_heads, i, d, generator=g).requires_grad_() for i in lengths]
    weights = [torch.randn(b, heads, i, d, generator=g) for i in lengths]
    cache, start, outs = KVCache(sum(lengths)), 0, []
    dtype = LOW[precision]
    with forced_branch(branch) if branch else contextlib.nullcontext():
        with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
            for qs, ks, vs in zip(q, k, v, strict=True):
                # Under autocast the projections hand attention low-precision q, k, v, as on the GPU.
                qs, ks, vs = (t.to(dtype) if dtype else t for t in (qs, ks, vs))
                outs.append(attend(qs, ks, vs, cache, start, gqa=heads != kv_heads))
                start += qs.shape[2]
    loss = sum((o.float() * w).sum() for o, w in zip(outs, weights, strict=True))
    grads = torch.autograd.grad(loss, q + k + v)
    return [o.detach().float() for o in outs] + [x.float() for x in grads]


# The CPU computes both branches with the same kernels; only the order of the keys' and values' gradient sums
# differs (the CPU branch reverses the queries): fp32 agrees to rounding, bf16/fp16 to a few units of the last place.
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 4e-3}


def _max_rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)], ids=["multi-head", "grouped-query"])
def test_attention_over_the_cache_takes_the_cuda_branch_to_the_cpu_result(precision, heads, kv_heads):
    cpu = _sliced_attention(None, precision, heads, kv_heads)
    cuda = _sliced_attention("cuda", precision, heads, kv_heads)
    assert _max_rel(cuda, cpu) <= TOLERANCE[precision]


def test_the_attention_negative_control_fails(monkeypatch):
    """The CUDA branch with the top-left causal alignment (each slice's first query sees no context): the outputs
    of every slice after the first differ, far beyond the tolerance."""
    from torch.nn.attention import bias

    cpu = _sliced_attention(None, "fp32", 4, 4)
    monkeypatch.setattr(bias, "causal_lower_right", bias.causal_upper_left)  # attention imports it when it runs
    broken = _sliced_attention("cuda", "fp32", 4, 4)
    assert _max_rel(broken, cpu) > 100 * TOLERANCE["fp32"]


def test_grouped_query_heads_are_expanded_on_the_fp32_cuda_branch_only():
    q, kv = torch.zeros(1, 4, 3, 8), torch.arange(2.0).view(1, 2, 1, 1).expand(1, 2, 3, 8)
    assert attention.expand_for_kernel(q, kv, kv, True)[2] is True  # the CPU: the kernel reads the groups
    with forced_branch("cuda"):
        keys, values, gqa = attention.expand_for_kernel(q, kv, kv, True)
        assert attention.expand_for_kernel(q.bfloat16(), kv, kv, True)[2] is True  # bf16: flash takes groups
    assert gqa is False and keys.shape == (1, 4, 3, 8)
    assert keys[0, :, 0, 0].tolist() == [0.0, 0.0, 1.0, 1.0]  # query head h reads key head h // 2


def test_the_grouped_query_negative_control_fails(monkeypatch):
    """Key/value heads repeated as a block (``repeat``) instead of each for its own group: query head 1 reads key
    head 1, not 0, and the comparison fails."""
    cpu = _sliced_attention(None, "fp32", 4, 2)

    def tiled(q, keys, values, gqa):
        group = q.shape[1] // keys.shape[1]
        return keys.repeat(1, group, 1, 1), values.repeat(1, group, 1, 1), False

    monkeypatch.setattr(attention, "expand_for_kernel", tiled)
    assert _max_rel(_sliced_attention("cuda", "fp32", 4, 2), cpu) > 100 * TOLERANCE["fp32"]


def _adamw_steps(fused_branch: bool, steps: int = 4) -> list[torch.Tensor]:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    with forced_branch("cuda") if fused_branch else contextlib.nullcontext():
        optimizer = make_optimizer(module, lr=1e-2)
    assert all(g["fused"] is (True if fused_branch else None) for g in optimizer.param_groups)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in module.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
    return [p.detach().clone() for p in module.parameters()]


def test_the_fused_adamw_of_cuda_updates_as_the_cpus_multi_tensor_one():
    fused, foreach = _adamw_steps(True), _adamw_steps(False)
    assert _max_rel(fused, foreach) < 1e-6


# Schedules under NCCL's rules: (slices, stages, run arguments, plan fields). Every order, interleaved chunks (on two
# devices the activations go both ways between the same two ranks), an uneven partition, D and T.
NCCL_FAMILIES = {
    "GPipe, uneven token slices": ([(2, [13, 1, 11, 7])], 2, {}, {}),
    "K=3": ([(1, [16, 8, 8])] * 2, 3, {}, {}),
    "1F1B, 4 batch slices": ([(1, [8, 24])] * 4, 2, {}, {"order": "1f1b"}),
    "2 virtual stages, GPipe order": (
        [(2, [16, 8, 8]), (1, [8, 24])], 2, {}, {"virtual_stages": 2, "layers_per_stage": [1, 2, 2, 1]}
    ),
    "2 virtual stages, 1F1B order": (
        [(2, [16, 16]), (1, [8, 8, 16]), (1, [32])], 2, {},
        {"virtual_stages": 2, "layers_per_stage": [1, 2, 2, 1], "order": "1f1b"},
    ),
    "uneven partition, 2 virtual stages on 3 devices, 1F1B": (
        [(2, [8, 8, 16]), (1, [32])], 3, {},
        {"virtual_stages": 2, "layers_per_stage": [0, 2, 1, 1, 2, 0], "order": "1f1b"},
    ),
    "2 virtual stages on 4 devices, 1F1B, 4 batch slices": (
        [(1, [8, 8, 16])] * 4, 4, {"layers": 8},
        {"virtual_stages": 2, "layers_per_stage": [1] * 8, "order": "1f1b", "recompute": [False] * 8},
    ),
    "T=2, K=2, D=2": ([(1, [16, 16])], 2, {"tensor_parallel": 2, "data_parallel": 2}, {}),
    # Zero-bubble: the gradient goes after I, so the receives follow the sender's I's, not its W's.
    "ZB-H1, K=3, two batch slices sliced differently": ([(1, [20, 12]), (1, [5, 5, 22])], 3, {}, {"order": "zb1p"}),
    "ZB-H1, 2 virtual stages": (
        [(2, [16, 16]), (1, [8, 8, 16]), (1, [32])], 2, {},
        {"virtual_stages": 2, "layers_per_stage": [1, 2, 2, 1], "order": "zb1p"},
    ),
    # ZB-V: activations down the V and back up, gradients the other way — every channel carries messages.
    "ZB-V, K=3": ([(1, [20, 12]), (1, [5, 5, 22])], 3, {}, {"order": "zbv", "virtual_stages": 2,
                                                           "recompute": [False] * 6}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(NCCL_FAMILIES))
def test_every_order_trains_under_nccls_message_rules(name):
    """With the CUDA branches forced too (attention through ``causal_lower_right``, fused AdamW): the single-device
    numbers, as a GPU node with one GPU per stage would compute them."""
    slices, stages, args, fields = NCCL_FAMILIES[name]
    with forced_branch("cuda"):
        setup = local_setup(slices, stages=stages, plan_fields=fields, **TWO_STEPS, **args)
        result, _ = verify_locally(setup, rules="nccl")
    assert result.ok, [(c.what, c.max_rel, c.tolerance) for c in result.checks]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_grouped_query_llama_trains_on_the_cuda_branches_under_nccls_rules(precision):
    """Grouped-query attention in fp32 takes the expansion of the key/value heads (the fused CUDA kernels have no
    grouped mode in fp32), in bf16 the kernel's own grouped mode; interleaved 1F1B, token slices."""
    from test_llama_trainer import llama_model

    fields = {"virtual_stages": 2, "layers_per_stage": [1, 2, 2, 1], "order": "1f1b"}
    setup = local_setup([(2, [16, 16]), (1, [8, 8, 16])], stages=2, model=llama_model(), plan_fields=fields,
                        precision=precision, **TWO_STEPS)  # fmt: skip
    with forced_branch("cuda"):
        result, _ = verify_locally(setup, rules="nccl")
    assert result.ok, [(c.what, c.max_rel, c.tolerance) for c in result.checks]


def test_a_hand_written_schedule_trains_under_nccls_message_rules():
    """Stage 1 takes the tiles in another order than stage 0 sends them: its receives follow stage 0's order."""
    setup = local_setup([(1, [16, 16]), (1, [32])], stages=2)
    text = "0F0.0, 0F0.1, 0F1, 0B1, 0B0.1, 0B0.0\n1F1, 1B1, 1F0.0, 1F0.1, 1B0.1, 1B0.0\n"
    result, _ = verify_locally(setup, parse_schedule(text, setup.plan.slices, 2), rules="nccl")
    assert result.ok


def test_receives_posted_in_the_receivers_own_order_fail_under_nccls_rules(monkeypatch):
    """Negative control: the receives posted tile by tile in the receiver's order, as gloo allows (tags pair them
    there). NCCL hands the first gradient sent (the last token slice's) to the receive of the first tile."""
    own_order = _StepWalk._messages_from
    monkeypatch.setattr(_StepWalk, "_messages_from", lambda self, device, phase: sorted(
        own_order(self, device, phase), key=lambda m: m[2]))  # fmt: skip
    setup = local_setup([(2, [8, 8, 16])], stages=2)
    verify_locally(setup)  # gloo's rules: still fine
    with pytest.raises(Exception, match="NCCL pairs rank 1's send of a gradient"):
        verify_locally(setup, rules="nccl")


def test_one_process_group_for_both_directions_deadlocks_in_1f1b_order():
    """Negative control: every message on one process group, as a single NCCL communicator would carry them: the
    gradient receive stage 0 posts at its first backward stays at the head of the pair's stream, and the
    activation it sends next waits behind it, while stage 1 waits for that activation — a deadlock, found as
    such (every rank waits, none can move), not by a time-out."""
    slices, stages, args, fields = NCCL_FAMILIES["1F1B, 4 batch slices"]
    setup = local_setup(slices, stages=stages, plan_fields=fields, **args)
    with pytest.raises(Exception, match="deadlock"):
        verify_locally(setup, rules="nccl", group_of=lambda channel_name: "one group")


def _staged_messages(rank: int, init: str, out: str) -> None:
    """Two gloo processes: rank 0 sends an activation and rank 1 a gradient back, each through `p2p.Links` with
    host staging forced and without; then an all-reduce and an uneven all-gather through `comm.DistGroup` both
    ways. Rank 1 saves what it got."""
    import torch.distributed as dist

    from terapipe_cli.engine.comm import DistGroup
    from terapipe_cli.engine.p2p import Links
    from terapipe_cli.schedule.schedule import Tile

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    tile = Tile(batch_slice=0, token_slice=0, batch_start=0, batch_size=2, token_start=0, tokens=3)
    got = {}
    for staged in (True, False):
        link = Links(prev_rank=None, next_rank=None, hidden=4, dtype=torch.float32, device=torch.device("cpu"),
                     timeout_s=30, staged=staged)  # fmt: skip
        message = torch.arange(24.0).view(2, 3, 4) * (rank + 1)
        posted = link.post_recvs([(("F" if rank else "B", 0, tile), tile, 7)], src=1 - rank)
        link.send(message, 1 - rank, 7, "a test message", phase="B" if rank else "F")
        (key,) = posted
        got[f"message {staged}"] = link.wait(posted[key], "a test message", 1 - rank)
        link.finish_sends()
        summed = torch.full((5,), float(rank + 1))
        DistGroup(None, 2, staged=staged).all_reduce(summed)
        got[f"sum {staged}"] = summed
        got[f"gather {staged}"] = DistGroup(None, 2, staged=staged).all_gather(torch.full((2 + rank, 3), 1.0 + rank),
                                                                                 0, [2, 3])  # fmt: skip
    if rank == 1:
        torch.save(got, out)
    dist.destroy_process_group()


def test_host_staged_messages_and_collectives_equal_direct_ones_between_two_processes(tmp_path):
    """Stages sharing a GPU talk over gloo through host memory; forced on the CPU, those copies deliver what the
    direct path delivers (messages, all-reduce, uneven all-gather)."""
    import torch.multiprocessing as mp

    out = tmp_path / "got.pt"
    mp.start_processes(_staged_messages, args=(f"file://{tmp_path / 'store'}", str(out)), nprocs=2, start_method="fork")
    got = torch.load(out)
    assert torch.equal(got["message True"], torch.arange(24.0).view(2, 3, 4))
    for what in ("message", "sum", "gather"):
        assert torch.equal(got[f"{what} True"], got[f"{what} False"]), what
    assert got["sum True"].tolist() == [3.0] * 5
    assert torch.equal(got["gather True"], torch.cat([torch.ones(2, 3), torch.full((3, 3), 2.0)]))
