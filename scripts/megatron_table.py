#!/usr/bin/env python3
"""Predicted per-GPU teraFLOP/s of Megatron-LM's PTD-P weak-scaling settings on DGX A100 nodes, and of terapipe's
own plan for the same settings.

The ten settings are Table 1 of Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", SC'21): GPT models of 1.7B to 1008B parameters, vocabulary 51200, sequences of 2048
tokens, tensor parallelism T inside a node, pipeline parallelism P, data parallelism D = GPUs / (T·P), so each of
the D pipeline replicas runs B = batch / D sequences a step. Both predictions price one replica on the same
analytic profile of the model on ``configs/hardware/dgx-a100.toml`` at tensor parallelism T (a roofline of every
kernel from datasheet constants: nothing here is measured or fitted to a measurement):

(a) Megatron-like: what the paper ran. Microbatches of one whole sequence, ``[(1, [2048])] * B``, every chunk
    recomputing its forward in its backward, Megatron-LM's interleaved 1F1B schedule (`megatron_rows`, as
    ``forward_backward_pipelining_with_interleaving`` orders it) with v chunks per device, v the smallest number
    from 2 up that splits each device's layers into equal chunks (Megatron-LM requires equal chunks), on equal
    chunks; plain 1F1B where P = 1 (no pipeline, K = 1).
(b) terapipe: `plan_configured` for the same D, T, P and B with the order, v, the partition of the layers and the
    recomputation left to the planner, within the A100's 80 GiB (the memory estimate of docs/design.md §10): token
    slices and batch slices chosen by the exact search. The profile times batch slices of 1, 2, 4 and 8
    sequences (`BATCH_SIZES`) and the planner prices nothing beyond its grid, so batch slices hold at most 8
    sequences; the token step g (slice lengths are multiples of g, column "g") is 8, or coarser where the planner
    took more than a minute at g = 8 (`TOKEN_STEP`).
(b') terapipe, recomputed: the same with every chunk recomputing, as Megatron-LM's runs did. Where (b) drops the
    recomputation, (b') shows what the slicing, the order, v and the partition gain on their own.

Every scheme is priced with the runtime's fused attention (the hardware file's ``[training] attention``, which says
why), not the dense attention of Megatron-LM's 2021 runs; the column "(a) dense attention" prices (a) again with it
(its time only: the memory estimate counts the fused kernel's tensors).

Per-GPU teraFLOP/s = the model FLOPs of one step / (the predicted step time × the GPUs), by the count `terapipe
plan` and `terapipe report` use (`plan.mfu.step_flops`): 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)), the same for
every scheme whether it recomputes or not (`model_flops`). The paper's eq. 3 counts 96·B·s·l·h²·(1 + s/(6h) +
V/(16·l·h)), the forward of the layers run again by the recomputation included — exactly this count with the
recomputed forward (`model_flops(recompute=True)`); the "paper's count" column is (a) counted so, comparable with
its published figures. The predicted step time is the schedule simulator's (transfers
overlapping compute, the data-parallel all-reduce and optimizer step after the last backward); the objective's
closed formula is shown beside it.

The embedding and the LM head are split over the T ranks by vocabulary, as Megatron-LM and the runtime split them
(`analytic_profile(vocab_parallel=True)`), in time and in memory.

    python scripts/megatron_table.py                    # all ten settings (18 minutes on 2 busy cores)
    python scripts/megatron_table.py --settings 1,2,3   # a subset
    python scripts/megatron_table.py --markdown         # a Markdown table for docs/results.md
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from terapipe_cli.cli.console import ProgressBar  # noqa: E402
from terapipe_cli.config.hardware import Hardware, load_hardware  # noqa: E402
from terapipe_cli.errors import UserError  # noqa: E402
from terapipe_cli.models import GptConfig  # noqa: E402
from terapipe_cli.plan.choice import choice_text  # noqa: E402
from terapipe_cli.plan.configs import Configured, plan_configured  # noqa: E402
from terapipe_cli.plan.costmodel import CostModel, Profile, profile_from_dict  # noqa: E402
from terapipe_cli.plan.file import short_form  # noqa: E402
from terapipe_cli.plan.memory import stage_memory  # noqa: E402
from terapipe_cli.plan.mfu import step_flops  # noqa: E402
from terapipe_cli.plan.request import plan_request  # noqa: E402
from terapipe_cli.plan.search import evaluate  # noqa: E402
from terapipe_cli.plan.simulate import simulate  # noqa: E402
from terapipe_cli.profile.analytic import analytic_profile  # noqa: E402
from terapipe_cli.schedule.partition import Partition  # noqa: E402
from terapipe_cli.schedule.schedule import CUSTOM, Action, Schedule, Tile, plan_tiles  # noqa: E402

HARDWARE = ROOT / "configs" / "hardware" / "dgx-a100.toml"
VOCAB = 51200
SEQ_LEN = 2048
BATCH_SIZES = (1, 2, 4, 8)  # the profile's batch-slice sizes: the planner searches no larger batch slice
DEFAULT_TOKEN_STEP = 8
# Settings whose plan took more than a minute at g = 8 on this machine (2 cores shared with other jobs) are planned at
# a coarser token step: 145.6B 91 s at g = 8, 37 s at 16; 310.1B 46 s at 32. The 529.6B and 1008B plans take minutes
# at any step (64: 119 s and 451 s; 128: no faster): there the search within the memory limit
# (`choice.plan_within_memory`) took 190 of 259 s of the 529.6B's recomputed plan in a profile, not the slicing DP.
# 39.1B took 71-108 s at g = 8 but 228 s at 16, so it stays at g = 8.
TOKEN_STEP = {7: 16, 8: 32, 9: 32, 10: 64}


@dataclass(frozen=True)
class Setting:
    """One row of Narayanan et al. 2021, Table 1."""

    number: int
    params_b: float  # billions of parameters, as the paper names the model
    heads: int
    hidden: int
    layers: int
    tensor_parallel: int  # T
    pipeline: int  # P
    gpus: int
    batch: int  # the global batch, in sequences
    published_tflops: float  # achieved teraFLOP/s per GPU, counted with the paper's 96 (recomputation included)

    @property
    def data_parallel(self) -> int:
        return self.gpus // (self.tensor_parallel * self.pipeline)

    @property
    def batch_per_replica(self) -> int:
        return self.batch // self.data_parallel

    def model(self) -> GptConfig:
        return GptConfig(f"megatron-{self.params_b:g}b", self.layers, self.hidden, self.heads, VOCAB, SEQ_LEN)


# Narayanan et al. 2021, Table 1: parameters (billions), heads, hidden, layers, T, P, GPUs, global batch, achieved
# teraFLOP/s per GPU. Transcribed from two independent copies of the table (the MLCarbon repository's
# data/megatron_table.csv and a reading note of the paper), which agree on every value; the abstract's "52% of
# theoretical peak" at 1T parameters is 163 of 312.
SETTINGS = tuple(
    Setting(n, *row)
    for n, row in enumerate(
        [
            (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
            (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
            (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
            (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
            (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
            (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
            (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
            (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
            (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
            (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
        ],
        start=1,
    )
)


def model_flops(setting: Setting, *, recompute: bool = False) -> float:
    """The FLOPs of one training step of the global batch by the one count of plan, report and scripts
    (`plan.mfu.step_flops`, `models.flops_per_token`): 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)), the model's FLOPs.
    With ``recompute`` the forward of the layers again: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)), Narayanan et al.
    2021, eq. 3, exactly (the LM head is not recomputed). Eq. 3 with 72 in place of 96, as this script counted before,
    left out a quarter of the head's 6·V·h per token."""
    return step_flops(setting.model(), SEQ_LEN, setting.batch, recompute=float(recompute))


def tflops_per_gpu(setting: Setting, step_s: float, *, recompute: bool = False) -> float:
    return model_flops(setting, recompute=recompute) / (step_s * setting.gpus) / 1e12


def setting_profile(setting: Setting, hardware: Hardware, token_step: int) -> Profile:
    """The analytic profile of the setting's model at its T, the embedding and the head split over the T ranks by
    vocabulary (Megatron-LM's split, which the runtime runs too)."""
    obj = analytic_profile(
        setting.model(),
        hardware,
        tensor_parallel=setting.tensor_parallel,
        batch_sizes=BATCH_SIZES,
        token_step=token_step,
        vocab_parallel=True,
    )
    return profile_from_dict(obj, f"analytic profile of setting {setting.number} on {hardware.path}")


def megatron_virtual(setting: Setting) -> int:
    """v of the Megatron-like scheme: the smallest v ≥ 2 that cuts each device's layers into equal chunks (Megatron-LM
    requires equal chunks), 1 without a pipeline or when no such v exists."""
    per_device, P = setting.layers // setting.pipeline, setting.pipeline
    if P == 1 or setting.layers % P:
        return 1
    return next((v for v in range(2, per_device + 1) if per_device % v == 0), 1)


def megatron_rows(tiles: list[Tile], devices: int, virtual: int) -> list[list[Action]]:
    """Megatron-LM's 1F1B orders, per device, for microbatches of one tile each (Narayanan et al. 2021, §2.2;
    ``forward_backward_pipelining_with_interleaving`` and ``..._without_interleaving`` of its schedules.py).

    The n-th forward of device k runs microbatch ⌊n / (K·v)⌋·K + n mod K through its local chunk ⌊(n mod K·v) / K⌋:
    groups of K microbatches go through the device's first chunk, then its second, and so on; the n-th backward
    runs the same microbatch through the chunks in reverse. Device k runs (K − k − 1)·2 + (v − 1)·K forwards ahead
    (K − k − 1 without interleaving; all of them when there are only K microbatches), then one forward and one
    backward in turn, then the backwards left."""
    M, K, v = len(tiles), devices, virtual
    if v > 1 and M % K:
        raise ValueError(f"Megatron-LM's interleaved schedule needs the microbatches ({M}) to be a multiple of K ({K})")
    total = M * v
    rows = []
    for k in range(K):
        if v == 1:
            warmup = min(K - k - 1, M)
        elif M == K:
            warmup = total
        else:
            warmup = min((K - k - 1) * 2 + (v - 1) * K, total)

        def action(phase: str, n: int, k: int = k) -> Action:
            local = (n % (K * v)) // K
            if phase == "B":
                local = v - 1 - local
            return Action(phase, tiles[(n // (K * v)) * K + n % K], local * K + k)

        row = [action("F", n) for n in range(warmup)]
        for n in range(total - warmup):
            row += [action("F", n + warmup), action("B", n)]
        row += [action("B", n) for n in range(total - warmup, total)]
        rows.append(row)
    return rows


@dataclass
class Scheme:
    """A scheme priced on a profile: its slices, chunks, order, recomputation and predicted step."""

    slices: list
    partition: Partition
    order: str  # "1F1B, recomputed", "GPipe", …
    formula_s: float  # the objective's closed formula
    simulated_s: float  # the schedule simulator
    peak_bytes: float  # the memory estimate of the fullest device


def megatron_like(profile: Profile, setting: Setting) -> Scheme:
    """(a): whole-sequence microbatches of one sequence, recomputed, in Megatron-LM's (interleaved) 1F1B order."""
    P, D, B = setting.pipeline, setting.data_parallel, setting.batch_per_replica
    partition = Partition.balanced(setting.layers, P, megatron_virtual(setting))
    slices = [(1, [SEQ_LEN])] * B
    cost = CostModel(profile, P, D, recompute=True, partition=partition)
    recompute = (True,) * partition.chunks
    rows = megatron_rows(plan_tiles(slices), P, partition.virtual)
    schedule = Schedule.of_rows(slices, P, CUSTOM, rows, recompute, partition)
    schedule.walk()  # raises if the order could deadlock
    memory = stage_memory(schedule, profile)
    return Scheme(
        slices=slices,
        partition=partition,
        order=choice_text("1f1b", recompute).replace(" order", ""),
        formula_s=evaluate(cost, slices, P),
        simulated_s=simulate(schedule, cost).latency_s,
        peak_bytes=max(m.total_bytes for m in memory) if memory else float("nan"),
    )


def terapipe_plan(
    profile: Profile, setting: Setting, token_step: int, recompute: bool | None = None
) -> tuple[Configured, Scheme]:
    """(b): terapipe's plan, everything but D, T, P and B left to the planner, within the device memory; with
    ``recompute=True`` every chunk recomputes, as in Megatron-LM's runs (b')."""
    request = plan_request(
        profile,
        stages=setting.pipeline,
        batch_size=setting.batch_per_replica,
        data_parallel=setting.data_parallel,
        tensor_parallel=setting.tensor_parallel,
        token_step=token_step,
        order=None,
        recompute=recompute,
        virtual=None,
        partition="auto",
    )
    # A baseline whose batch slices lie beyond the profile's grid costs +inf, and with K = 1 its bubble term is
    # 0·inf: numpy warns, the search skips it (a NaN objective is never the best).
    with np.errstate(invalid="ignore"):
        configured = plan_configured(profile, request)
    p = configured.planned
    scheme = Scheme(
        slices=p.terapipe.slices,
        partition=p.partition,
        order=p.choice_text().replace(" order", ""),
        formula_s=p.terapipe.predicted_s,
        simulated_s=p.simulated_s["terapipe"],
        peak_bytes=p.memory.peak_bytes if p.memory is not None else float("nan"),
    )
    return configured, scheme


@dataclass
class Row:
    setting: Setting
    token_step: int
    megatron: Scheme
    megatron_dense: Scheme  # (a) priced with dense attention, as Megatron-LM's runs computed it
    terapipe: Scheme
    recomputed: Scheme  # terapipe's plan with every chunk recomputing (b')
    planner_s: tuple[float, float]  # wall seconds of `plan_configured`, for (b) and (b')

    def tflops(self, scheme: Scheme, *, recompute: bool = False) -> float:
        return tflops_per_gpu(self.setting, scheme.simulated_s, recompute=recompute)

    def ratio(self, scheme: Scheme) -> float:
        """How much faster than (a) ``scheme`` runs a step (simulated)."""
        return self.megatron.simulated_s / scheme.simulated_s


def plan_setting(setting: Setting, hardware: Hardware, token_step: int | None = None) -> Row:
    g = token_step or TOKEN_STEP.get(setting.number, DEFAULT_TOKEN_STEP)
    profile = setting_profile(setting, hardware, g)
    megatron = megatron_like(profile, setting)
    dense = replace(hardware, training=replace(hardware.training, attention="dense"))
    megatron_dense = megatron_like(setting_profile(setting, dense, g), setting)
    schemes, seconds = [], []
    for recompute in (None, True):
        start = time.perf_counter()
        schemes.append(terapipe_plan(profile, setting, g, recompute)[1])
        seconds.append(time.perf_counter() - start)
    return Row(setting, g, megatron, megatron_dense, *schemes, tuple(seconds))


def _seconds(scheme: Scheme) -> str:
    return f"{scheme.simulated_s:.2f} ({scheme.formula_s:.2f})"


def _chunks(part: Partition) -> str:
    """``v=2: 12 12 | 12 12`` (layers per chunk, by round)."""
    return f"v={part.virtual}: {part.text()}"


def _cells(row: Row) -> list[str]:
    s, a, b, c = row.setting, row.megatron, row.terapipe, row.recomputed
    return [
        str(s.number),
        f"{s.params_b:g}B",
        str(s.tensor_parallel),
        str(s.pipeline),
        str(s.data_parallel),
        str(s.batch_per_replica),
        str(row.token_step),
        _chunks(a.partition),
        _seconds(a),
        f"{row.tflops(a):.0f}",
        f"{row.tflops(a, recompute=True):.0f}",
        f"{row.tflops(row.megatron_dense, recompute=True):.0f}",
        f"{s.published_tflops:g}",
        short_form(b.slices, fold=True),
        f"{b.order}; {_chunks(b.partition)}",
        _seconds(b),
        f"{row.tflops(b):.0f}",
        f"{row.ratio(b):.2f}x",
        short_form(c.slices, fold=True),
        f"{c.order}; {_chunks(c.partition)}",
        _seconds(c),
        f"{row.tflops(c):.0f}",
        f"{row.ratio(c):.2f}x",
        f"{row.planner_s[0]:.1f} / {row.planner_s[1]:.1f}",
        " / ".join(f"{x.peak_bytes / 2**30:.0f}" for x in (a, b, c)),
    ]


HEADERS = [
    "#",
    "model",
    "T",
    "P",
    "D",
    "B",
    "g",
    "(a) chunks",
    "(a) step s",
    "(a) TFLOP/s",
    "(a) paper's count",
    "(a) dense attention, paper's count",
    "published",
    "(b) terapipe scheme",
    "(b) order; chunks",
    "(b) step s",
    "(b) TFLOP/s",
    "(b)/(a)",
    "(b') recomputed scheme",
    "(b') order; chunks",
    "(b') step s",
    "(b') TFLOP/s",
    "(b')/(a)",
    "planner s (b) / (b')",
    "peak GiB (a) / (b) / (b')",
]
SCHEME_COLUMNS = {
    "(a) chunks",
    "(b) terapipe scheme",
    "(b) order; chunks",
    "(b') recomputed scheme",
    "(b') order; chunks",
}


def render_rich(rows: list[Row], console: Console, title: str, note: str) -> None:
    table = Table(title=title, caption=note, caption_justify="left")
    for h in HEADERS:
        table.add_column(h, justify="left" if h in SCHEME_COLUMNS else "right")
    for row in rows:
        table.add_row(*_cells(row))
    console.print(table)


def render_markdown(rows: list[Row], note: str) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    for row in rows:
        cells = [cell.replace("|", "\\|") for cell in _cells(row)]  # a partition's rounds: ``12 12 | 12 12``
        cells[13], cells[18] = f"`{cells[13]}`", f"`{cells[18]}`"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", note])


def parse_settings(text: str | None) -> list[Setting]:
    if not text:
        return list(SETTINGS)
    try:
        numbers = [int(x) for x in text.split(",")]
    except ValueError:
        raise UserError(
            f"expected setting numbers separated by commas, e.g. 1,2,3, got {text!r}", where="--settings"
        ) from None
    bad = [n for n in numbers if not 1 <= n <= len(SETTINGS)]
    if bad:
        raise UserError(f"setting {bad[0]} does not exist (1 to {len(SETTINGS)})", where="--settings")
    return [SETTINGS[n - 1] for n in numbers]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", help="plan only these settings of Table 1, e.g. 1,2,3 (default: all ten)")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table (for docs/results.md)")
    ap.add_argument("--hardware", default=str(HARDWARE), help="the hardware file (default: configs/hardware/dgx-a100)")
    ap.add_argument("--token-step", type=int, help="plan every setting at this token step (default: 8, see TOKEN_STEP)")
    args = ap.parse_args(argv)
    # Piped into a file, rich would wrap rows at 80 columns; a wide canvas keeps one line per setting.
    console = Console(width=None if sys.stdout.isatty() else 400)
    try:
        settings = parse_settings(args.settings)
        hardware = load_hardware(args.hardware)
        rows: list[Row] = []
        start = time.perf_counter()
        with ProgressBar(Console(stderr=True)) as update:  # the CLI's bar, with its ETA
            for done, setting in enumerate(settings):
                update(f"planning (setting {setting.number}, {setting.params_b:g}B)", done, len(settings))
                rows.append(plan_setting(setting, hardware, args.token_step))
            update("planning (all settings)", len(settings), len(settings))
        total = time.perf_counter() - start
    except UserError as e:
        sys.stderr.write(f"megatron_table: error: {e}\n")
        return 2
    title = (
        f"Megatron-LM's PTD-P settings on {hardware.name} ({hardware.constants} constants): predicted model "
        "teraFLOP/s per GPU, Megatron-like (a) against terapipe's plan (b) and its plan recomputed (b'); "
        f"{total:.1f} s in all"
    )
    note = (
        "ESTIMATED from an analytic profile (datasheet roofline, nothing measured or calibrated on an A100). TFLOP/s: "
        "model FLOPs (the paper's eq. 3 with 72, no recomputation) over the simulated step and the GPUs. "
        "Paper's count: (a) with the paper's 96 (its recomputed forward counted), comparable with the published "
        "figures (Narayanan et al. 2021, Table 1); dense attention: the same with the scores written to memory, as "
        "Megatron-LM computed them. (a): microbatches of one sequence, recomputed, Megatron-LM's (interleaved) 1F1B "
        "order, equal chunks. (b): terapipe's plan within 80 GiB, its order, v, partition and recomputation chosen "
        "by the planner; (b'): the same, recomputed on every chunk. Batch slices of at most 8 sequences (the "
        "profile's grid), token slices in multiples of g. Step seconds per replica: simulated (formula). Priced "
        "with fused attention but for the dense column; embedding and head split over the T ranks by vocabulary."
    )
    if args.markdown:
        print(f"{title}\n")
        print(render_markdown(rows, note))
    else:
        render_rich(rows, console, title, note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
