"""An order's layout (`schedule.layout`): what an order runs depends only on how many token slices each batch slice
has, so one layout serves every scheme of those counts — `Schedule.build` is the order's own rows, and the planner's
walks of a scheme without its schedule (`simulate.scheme_latency`, `memory.scheme_memory`) give exactly the numbers
of the schedule's walks, in every order, placement, recomputation and tracing of memory."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from terapipe_cli.models import ModelConfig
from terapipe_cli.plan.costmodel import CostModel, read_profile
from terapipe_cli.plan.memory import scheme_memory, stage_memory
from terapipe_cli.plan.simulate import scheme_latency, simulated_latency
from terapipe_cli.plan.traced import traced_from_dict
from terapipe_cli.schedule import memo
from terapipe_cli.schedule.actions import plan_tiles
from terapipe_cli.schedule.orders import ALL_ORDERS, order_of
from terapipe_cli.schedule.partition import Partition
from terapipe_cli.schedule.schedule import Schedule, layout

ROOT = Path(__file__).resolve().parents[2]
GPT3 = read_profile(ROOT / "configs" / "profiles" / "gpt3-1b-h100-bf16-measured.json")


def _traced(profile):
    """``profile`` with the memory of tests/data/memtrace-bf16.json's traces (`plan.traced`)."""
    obj = json.loads((ROOT / "tests" / "data" / "memtrace-bf16.json").read_text())
    cfg = ModelConfig.from_dict(dict(obj.pop("model"), layers=profile.model.layers), "memtrace")
    return replace(
        profile, model=cfg, params_per_layer=cfg.params_per_layer(1), activation_bytes_per_token_per_layer=None,
        memory=traced_from_dict(obj, "memtrace"),
    )  # fmt: skip


def _schemes(rng: random.Random, count: int):
    """Random schemes of 1–5 batch slices (1–4 sequences) of 1–4 token slices (multiples of 64 tokens, 512 in all)."""
    for _ in range(count):
        slices = []
        for _ in range(rng.randint(1, 5)):
            cuts = sorted(rng.sample(range(1, 8), rng.randint(0, 3)))
            units = [b - a for a, b in zip([0, *cuts], [*cuts, 8], strict=True)]
            slices.append((rng.choice([1, 2, 4]), [64 * u for u in units]))
        yield slices


def _configurations():
    for order in ALL_ORDERS:
        kind = order_of(order)
        for stages in (1, 2, 3, 4):
            for virtual in (2,) if kind.placement == "v" else (1, 2):
                if stages == 1 and virtual > 1:
                    continue
                yield order, stages, virtual


@pytest.mark.parametrize(("order", "stages", "virtual"), list(_configurations()))
def test_a_scheme_walked_by_its_layout_is_its_schedule_walked(order: str, stages: int, virtual: int) -> None:
    rng = random.Random(f"{order} {stages} {virtual}")
    kind = order_of(order)
    part = Partition.balanced(GPT3.model.layers, stages, virtual, kind.placement)
    traced = _traced(GPT3)
    with memo.sharing():
        for n, slices in enumerate(_schemes(rng, 4)):
            partition = None if virtual == 1 and n % 2 else part  # with one chunk per device, either way
            chunks = stages * virtual
            recompute = tuple(rng.random() < 0.5 for _ in range(chunks))
            schedule = Schedule.build(slices, stages, order, recompute, partition)
            tiles = plan_tiles(slices)
            own = kind.rows(tiles, len(slices), stages, virtual)
            assert [list(row) for row in schedule.actions] == own  # the layout is the order's own rows
            assert len(layout(slices, stages, order, virtual).rows) == stages
            for rerun in (False, True):
                cost = CostModel(GPT3, stages, recompute=rerun, partition=part)
                assert scheme_latency(cost, slices, stages, order, recompute, partition) == simulated_latency(
                    schedule, cost
                )
            for profile in (GPT3, traced) if n == 0 else (GPT3,):  # a traced walk is slow: one scheme
                assert scheme_memory(profile, slices, stages, order, recompute, partition) == stage_memory(
                    schedule, profile
                )
