#!/usr/bin/env python3
"""Where the analytic model's step for Megatron-LM's tensor-parallel-8 settings goes, and what published figures
for the links do to it.

For each setting, the Megatron-like scheme of `scripts/megatron_table.py` ((a): microbatches of one whole sequence,
recomputed, Megatron-LM's interleaved 1F1B with the smallest v ≥ 2 giving equal chunks) is priced on
``configs/hardware/dgx-a100.toml`` with the dense attention Megatron-LM ran in 2021 (the column "fused" is the
table's own (a), priced with the runtime's fused attention). The step is the schedule simulator's, as in that
table. Its parts, on the device that sets the pace (the slowest, by the cost model's ``cost``), for the whole step:

* compute: the layers' matrix products, attention and element-wise kernels (the forward twice: recomputation),
  and the ends (embedding, head), every link free;
* TP all-reduce: the tensor-parallel all-reduces as the model prices them, 2(T−1)·latency + 2(T−1)/T·bytes/bw
  with the hardware file's NVLink bandwidth and latency; six per layer and microbatch (two in the forward, two in
  the recomputed forward, two in the backward), message b·s·h·2 bytes;
* p2p: the stage-to-stage transfers as priced (latency + bytes / the node's 8 × 25 GB/s), and how much of them the
  simulator leaves on the step's path ("exposed": the step with them, less the step with free transfers);
* bubble: the simulated step less the pace-setting device's work and the per-step constant;
* step constant: the optimizer update and the data-parallel gradient all-reduce (the latter also alone).

Then each candidate is priced again from a published figure, one at a time, and all together, in this script only
(no cost model, hardware file or source file changes); "Δ" is the simulated step re-priced less the model's:

* TP all-reduce at a measured NCCL bus bandwidth: nccl-tests defines busbw = algbw·2(n−1)/n, so an all-reduce of
  S bytes over n GPUs takes 2(n−1)/n·S/busbw with the latency inside busbw; the model's bandwidth term with
  busbw in place of the link bandwidth and no latency term. Two published values for 8 × A100 over NVSwitch at
  large messages: 230 GB/s and 200 GB/s (see docs/results.md for the sources); the messages here (25–50 MB) are
  below where the curve flattens, so both are upper bounds on the bandwidth these all-reduces get;
* p2p as Megatron-LM ran it: each transfer blocks (its `_communicate` waits for the batched isend/irecv and
  synchronises the device before the next kernel), and the scatter/gather optimisation sends 1/T of the activation
  over each rank's HCA (25 GB/s) and then all-gathers it over NVLink (at the busbw above); priced as every
  transfer on the device's path, less what the model already exposes;
* DP all-reduce at a measured InfiniBand busbw: 85% of the HCAs' 25 GB/s per GPU;
* bubble without interleaving (v = 1): a sensitivity, not a candidate: Table 1 does not say which v each run used.

    python scripts/t8_breakdown.py             # the T = 8 settings 18.4B-174.6B and the T <= 4 controls (~30 s)
    python scripts/t8_breakdown.py --all       # every setting of Table 1 and Table 2 (several minutes)
    python scripts/t8_breakdown.py --markdown  # Markdown tables for docs/results.md
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

import megatron_table as mt  # noqa: E402
import numpy as np  # noqa: E402

from terapipe_cli.config.hardware import Hardware, Link, load_hardware  # noqa: E402
from terapipe_cli.models.spec import backward_gemms, layer_gemms  # noqa: E402
from terapipe_cli.plan.costmodel import CostModel, Profile, profile_from_dict  # noqa: E402
from terapipe_cli.plan.simulate import simulate  # noqa: E402
from terapipe_cli.profile.analytic import _gemm_seconds, analytic_profile  # noqa: E402
from terapipe_cli.schedule.partition import Partition  # noqa: E402
from terapipe_cli.schedule.schedule import CUSTOM, Schedule, plan_tiles  # noqa: E402

TOKEN_STEP = 256  # whole-sequence tiles only: the grid needs 2048, a coarse step keeps the context fit cheap
BUSBW = (230e9, 200e9)  # published nccl-tests all_reduce busbw, 8 × A100 on NVSwitch, large messages
HCA_BYTES_PER_S = 25e9  # one 200 Gbit/s HDR HCA per GPU (DGX A100 datasheet)
IB_EFFICIENCY = 0.85  # nccl-tests all_reduce busbw over HDR HCAs, measured ~85% of nominal on average
FREE = Link(bytes_per_s=float("inf"), latency_s=0.0)

# Narayanan et al. 2021, Table 2 (PTD parallelism rows): 174.6B (96 layers, h 12288, 96 heads) at T = 8, P = 12,
# global batch 1536; 529.6B (setting 9's shape) at T = 8, P = 35, global batch 2240; microbatch 1.
GPT3 = ((384, 153), (768, 149), (1536, 141))  # GPUs, published teraFLOP/s per GPU
BIG = ((560, 171), (1120, 167), (2240, 159))
TABLE2 = (
    *(mt.Setting(11 + n, 174.6, 96, 12288, 96, 8, 12, g, 1536, x) for n, (g, x) in enumerate(GPT3)),
    *(mt.Setting(14 + n, 529.6, 128, 20480, 105, 8, 35, g, 2240, x) for n, (g, x) in enumerate(BIG)),
)
ALL = (*mt.SETTINGS, *TABLE2)
DEFAULT = (1, 2, 3, 4, 5, 6, 7, 11, 12, 13)  # T <= 4 controls, then T = 8 from 18.4B to 174.6B


def published_step_s(s: mt.Setting) -> float:
    """The published throughput as a step time: the paper's eq. 3 (with 96, recomputation counted) over it."""
    return mt.model_flops(s, recompute=True) / (s.published_tflops * 1e12 * s.gpus)


def with_attention(hw: Hardware, attention: str) -> Hardware:
    return replace(hw, training=replace(hw.training, attention=attention))


def profile(s: mt.Setting, hw: Hardware, *, p2p: Link | None = None, dp: Link | None = None) -> Profile:
    """The setting's analytic profile; ``p2p`` and ``dp`` replace its stage-to-stage and data-parallel links."""
    obj = analytic_profile(s.model(), hw, tensor_parallel=s.tensor_parallel, batch_sizes=(1,), token_step=TOKEN_STEP)
    if p2p is not None:
        obj["comm"] = {"latency_s": p2p.latency_s, "bytes_per_s": p2p.bytes_per_s}
    if dp is not None:
        obj["data_parallel_link"] = {"latency_s": dp.latency_s, "bytes_per_s": dp.bytes_per_s}
    return profile_from_dict(obj, f"analytic profile of setting {s.number}")


def partition(s: mt.Setting, virtual: int | None = None) -> Partition:
    return Partition.balanced(s.layers, s.pipeline, mt.megatron_virtual(s) if virtual is None else virtual)


def simulated(prof: Profile, s: mt.Setting, virtual: int | None = None) -> float:
    """The Megatron-like scheme's simulated step (`megatron_table.megatron_like`, v chosen or given)."""
    part = partition(s, virtual)
    slices = [(1, [mt.SEQ_LEN])] * s.batch_per_replica
    cost = CostModel(prof, s.pipeline, s.data_parallel, recompute=True, partition=part)
    rows = mt.megatron_rows(plan_tiles(slices), s.pipeline, part.virtual)
    schedule = Schedule.of_rows(slices, s.pipeline, CUSTOM, rows, (True,) * part.chunks, part)
    return simulate(schedule, cost).latency_s


def device_work(prof: Profile, s: mt.Setting) -> tuple[float, CostModel]:
    """The pace-setting device's seconds for the whole step (every microbatch, every chunk it holds)."""
    cost = CostModel(prof, s.pipeline, s.data_parallel, recompute=True, partition=partition(s))
    one = np.array([1.0])
    return float(cost(one, np.array([float(mt.SEQ_LEN)]), 0 * one)[0]) * s.batch_per_replica, cost


def gemm_efficiency(s: mt.Setting, hw: Hardware) -> float:
    """The model's FLOP-weighted efficiency (of the peak) over one layer's weight products at T, forward and back."""
    dev, e, t = hw.device, hw.training.dtype_bytes, s.tensor_parallel
    fwd = [g for g in layer_gemms(s.model(), 1.0, float(mt.SEQ_LEN), 0.0, t) if g[0] not in ("scores", "values")]
    gemms = fwd + backward_gemms(fwd)
    flops = sum(2.0 * float(b * m * n * k) for _, b, m, n, k in gemms)
    seconds = sum(float(_gemm_seconds(dev, e, g)) for g in gemms)
    return flops / (dev.peak_flops * seconds)


def per_rank_shapes(s: mt.Setting) -> str:
    """The (N, K) of the layer's four weight products on one rank, M = 2048 tokens: qkv, proj, fc1, fc2."""
    h, t = s.hidden, s.tensor_parallel
    return f"{3 * h // t}×{h}, {h}×{h // t}, {4 * h // t}×{h}, {h}×{4 * h // t}"


def sg_link(s: mt.Setting, hw: Hardware, busbw: float) -> Link:
    """Megatron-LM's scatter/gather transfer as one link: 1/T of the activation over a rank's own HCA, then an
    all-gather over NVLink ((T−1)/T · bytes / busbw): seconds per byte 1/(T·HCA) + (T−1)/(T·busbw)."""
    t = s.tensor_parallel
    per_byte = 1.0 / (t * HCA_BYTES_PER_S) + (t - 1) / (t * busbw)
    return Link(bytes_per_s=1.0 / per_byte, latency_s=hw.network.latency_s)


@dataclass
class Row:
    s: mt.Setting
    published: float
    fused: float
    model: float
    compute: float
    tp: float
    p2p: float
    p2p_exposed: float
    bubble: float
    step_const: float
    dp: float
    gemm_eff: float
    memory_bound: float  # of compute: what an unbounded memory bandwidth takes off (element-wise, dense scores)
    needed_busbw: float  # the busbw at which the TP all-reduce alone would close the gap (nan: none would)
    d_tp: tuple[float, ...]  # Δ per BUSBW
    d_change: float  # Δ of the one change proposed: [intra_node] bytes_per_s = BUSBW[0], latency_s as in the file
    d_p2p: float
    d_dp: float
    d_all: float
    d_v1: float


def breakdown(s: mt.Setting, hw: Hardware) -> Row:
    dense = with_attention(hw, "dense")
    base = profile(s, dense)
    model = simulated(base, s)
    fused = simulated(profile(s, hw), s)
    work, cost = device_work(base, s)
    work_nocomm, _ = device_work(profile(s, dense, p2p=FREE), s)
    compute, _ = device_work(profile(s, replace(dense, intra_node=FREE), p2p=FREE), s)
    p2p = work - work_nocomm
    exposed = model - simulated(profile(s, dense, p2p=FREE), s) if s.pipeline > 1 else 0.0
    bubble = model - work - cost.step_s
    d_tp = tuple(simulated(profile(s, replace(dense, intra_node=Link(bw, 0.0))), s) - model for bw in BUSBW)
    change = replace(dense, intra_node=replace(dense.intra_node, bytes_per_s=BUSBW[0]))
    d_change = simulated(profile(s, change), s) - model
    # p2p as Megatron-LM ran it: every transfer on the device's path, scatter/gather with its all-gather at the
    # first (the higher) published busbw.
    link = sg_link(s, hw, BUSBW[0])
    blocking = (device_work(profile(s, dense, p2p=link), s)[0] - work_nocomm) if s.pipeline > 1 else 0.0
    d_p2p = blocking - exposed
    ib = Link(bytes_per_s=IB_EFFICIENCY * HCA_BYTES_PER_S, latency_s=hw.network.latency_s)
    d_dp = simulated(profile(s, dense, dp=ib), s) - model
    everything = profile(s, replace(dense, intra_node=Link(BUSBW[0], 0.0)), dp=ib, p2p=FREE)
    all_nocomm = simulated(everything, s)
    all_blocking = device_work(profile(s, replace(dense, intra_node=Link(BUSBW[0], 0.0)), p2p=link), s)[0]
    all_blocking -= device_work(everything, s)[0]
    d_all = all_nocomm + (all_blocking if s.pipeline > 1 else 0.0) - model
    d_v1 = simulated(base, s, virtual=1) - model if s.pipeline > 1 else 0.0
    fast = replace(dense, device=replace(dense.device, memory_bytes_per_s=1e6 * dense.device.memory_bytes_per_s))
    memory_bound = compute - device_work(profile(s, replace(fast, intra_node=FREE), p2p=FREE), s)[0]
    return Row(
        s, published_step_s(s), fused, model, compute, work_nocomm - compute, p2p, exposed, bubble, cost.step_s,
        cost.allreduce_s, gemm_efficiency(s, hw), memory_bound, needed_busbw(s, dense, published_step_s(s)),
        d_tp, d_change, d_p2p, d_dp, d_all, d_v1,
    )  # fmt: skip


def needed_busbw(s: mt.Setting, dense: Hardware, published: float) -> float:
    """The NCCL busbw (no latency term) at which the TP all-reduce alone brings the simulated step to the published
    one, by bisection on a log scale between 20 and 600 GB/s; nan when none in that range does. A diagnostic of what
    the all-reduce would have to achieve, to compare with published busbw at the message size, not a value to use."""

    def step(bw: float) -> float:
        return simulated(profile(s, replace(dense, intra_node=Link(bw, 0.0))), s)

    lo, hi = 20e9, 600e9
    if not step(hi) <= published <= step(lo):
        return float("nan")
    for _ in range(20):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if step(mid) > published else (lo, mid)
    return (lo * hi) ** 0.5


def gap(x: float, published: float) -> str:
    return f"{x / published - 1:+.1%}"


def ms(x: float) -> str:
    return f"{x * 1e3:+.0f}"


HEAD1 = [
    "#", "model", "T", "P", "D", "B", "v", "published s", "model s (dense)", "gap", "fused s", "gap (fused)",
    "compute s (memory-bound)", "TP all-reduce s", "message MB", "p2p s (exposed)", "bubble s",
    "optimizer + DP all-reduce s (DP)",
    "GEMM eff.", "per-rank (N×K) qkv, proj, fc1, fc2", "busbw closing the gap alone GB/s",
]  # fmt: skip
HEAD2 = [
    "#", "model", "published s", "model s", "gap",
    "Δ TP all-reduce @230 ms", "Δ TP all-reduce @200 ms", "Δ p2p blocking + all-gather ms", "Δ DP all-reduce @85% ms",
    "all three (@230) s", "gap", "sensitivity: Δ v = 1 ms", "Δ file change: 230e9, latency kept ms", "gap",
]  # fmt: skip


def cells1(r: Row) -> list[str]:
    s = r.s
    return [
        str(s.number), f"{s.params_b:g}B", str(s.tensor_parallel), str(s.pipeline), str(s.data_parallel),
        str(s.batch_per_replica), str(mt.megatron_virtual(s)), f"{r.published:.2f}", f"{r.model:.2f}",
        gap(r.model, r.published), f"{r.fused:.2f}", gap(r.fused, r.published),
        f"{r.compute:.2f} ({r.memory_bound:.2f})", f"{r.tp:.2f}", f"{mt.SEQ_LEN * s.hidden * 2 / 1e6:.1f}",
        f"{r.p2p:.3f} ({r.p2p_exposed:.3f})", f"{r.bubble:.2f}", f"{r.step_const:.2f} ({r.dp:.2f})",
        f"{r.gemm_eff:.3f}", per_rank_shapes(s),
        "—" if s.tensor_parallel == 1 or np.isnan(r.needed_busbw) else f"{r.needed_busbw / 1e9:.0f}",
    ]  # fmt: skip


def cells2(r: Row) -> list[str]:
    s, new = r.s, r.model + r.d_all
    return [
        str(s.number), f"{s.params_b:g}B T{s.tensor_parallel}", f"{r.published:.2f}", f"{r.model:.2f}",
        gap(r.model, r.published), *(ms(d) for d in r.d_tp), ms(r.d_p2p), ms(r.d_dp), f"{new:.2f}",
        gap(new, r.published), ms(r.d_v1) if s.pipeline > 1 else "—", ms(r.d_change),
        gap(r.model + r.d_change, r.published),
    ]  # fmt: skip


def render(rows: list[Row], markdown: bool) -> str:
    out = []
    for head, cells in ((HEAD1, cells1), (HEAD2, cells2)):
        body = [cells(r) for r in rows]
        if markdown:
            out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            out += ["| " + " | ".join(c) + " |" for c in body]
        else:
            widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
            for line in (head, *body):
                out.append("  ".join(x.rjust(w) for x, w in zip(line, widths, strict=True)))
        out.append("")
    return "\n".join(out)


def scaling(rows: list[Row]) -> str:
    """Table 2's three 174.6B rows hold P, T and the global batch and vary D, so a replica's microbatches M = 384, 192,
    96: step = a·M + b. The two outer rows give a (seconds per microbatch) and b (the step's fixed part: bubble and
    per-step constant), for the published steps, the model's, and the model's without interleaving (v = 1)."""
    rows = [r for r in rows if r.s.params_b == 174.6]
    if len(rows) < 2:
        return ""
    first, last = rows[0], rows[-1]
    m1, m2 = first.s.batch_per_replica, last.s.batch_per_replica
    lines = [f"174.6B (Table 2), step = a·M + b from M = {m1} and {m2}:"]
    for name, pick in (
        ("published", lambda r: r.published),
        ("model (v = 2)", lambda r: r.model),
        ("model, v = 1", lambda r: r.model + r.d_v1),
        ("model, all three (@230)", lambda r: r.model + r.d_all),
    ):
        a = (pick(first) - pick(last)) / (m1 - m2)
        b = pick(last) - a * m2
        lines.append(f"  {name:24s} a = {a * 1e3:6.1f} ms per microbatch   b = {b:5.2f} s ({b / a:4.1f} microbatches)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="every setting of Table 1 and Table 2 (slow: 1008B)")
    ap.add_argument("--markdown", action="store_true", help="Markdown tables for docs/results.md")
    args = ap.parse_args(argv)
    hw = load_hardware(mt.HARDWARE)
    chosen = ALL if args.all else [s for s in ALL if s.number in DEFAULT]
    rows = [breakdown(s, hw) for s in chosen]
    print(render(rows, args.markdown))
    print(scaling(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
