"""Run folders as `terapipe train` writes them, made without training (simulated, uniform-cost timelines), and
checks of the report's pictures and trace: what the report tests read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from conftest import tiny_model

from terapipe_cli.config.run import RunArguments
from terapipe_cli.engine.mesh import Layout
from terapipe_cli.plan.file import make_plan_dict
from terapipe_cli.plan.simulate import simulate
from terapipe_cli.schedule.schedule import Schedule
from terapipe_cli.schedule.timeline import write_timeline
from terapipe_cli.train.rundir import append_metrics, timeline_path, write_config, write_summary

SEQ = 32


def per_token_parts(forward_s_per_token: float):
    """Tiles cost in proportion to their tokens (backward twice the forward), transfers are free."""

    def parts(b, i, j, chunk: int = 0):
        f = np.asarray(b, dtype=float) * np.asarray(i, dtype=float) * forward_s_per_token
        return f, 2 * f, np.zeros_like(f), np.zeros_like(f)

    return parts


def make_run(
    path: Path,
    slices,
    *,
    stages: int = 2,
    steps: int = 6,
    replicas: int = 1,
    tensor: int = 1,
    model=None,
    losses=None,
    iteration_s=None,
    tile_s: float = 0.01,
    seed: int = 0,
    plan_extra: dict | None = None,
    plan: dict | None = None,
    records: list[dict] | None = None,
    arguments: dict | None = None,
):
    """A complete run directory as `terapipe train` writes it, with simulated (uniform-cost) timelines; ``plan``: a
    whole plan (else a tiny one over ``slices``), ``records``: fields added to each step's metrics record,
    ``arguments``: `RunArguments` fields set (weight_decay, decay_steps, ...)."""
    model = model or tiny_model(seq_len=SEQ)
    batch = sum(b for b, _ in slices)
    plan = plan or make_plan_dict(
        model=model,
        stages=stages,
        batch_size=batch,
        seq_len=SEQ,
        token_step=1,
        slices=slices,
        predicted_s=0.05,
        data_parallel=replicas,
        tensor_parallel=tensor,
        **(plan_extra or {}),
    )
    args = RunArguments(
        steps=steps,
        data=None,
        seed=seed,
        lr=1e-3,
        data_parallel=replicas,
        checkpoint_every=10,
        threads=1,
        timeout_s=60.0,
        verify=False,
        tensor_parallel=tensor,
        **(arguments or {}),
    )
    write_config(
        path,
        plan=plan,
        args=args,
        world_size=stages * replicas * tensor,
        device="cpu",
        backend="gloo",
        nnodes=1,
        versions={},
        created="2026-01-01T00:00:00+00:00",
    )
    losses = losses if losses is not None else [5.0 - 0.1 * s for s in range(steps)]
    seq_len = plan["seq_len"]
    sim = simulate(Schedule.build(slices, stages), per_token_parts(tile_s / seq_len), step_s=0.002)
    iteration_s = (
        iteration_s if iteration_s is not None else [sim.latency_s * (1.0 + 0.01 * (s % 3)) for s in range(steps)]
    )
    for s in range(steps):
        append_metrics(
            path,
            {
                "step": s + 1,
                "loss": losses[s],
                "iteration_s": iteration_s[s],
                "tokens_per_s": batch * replicas * seq_len / iteration_s[s],
                "memory_bytes": 1000 + s,
                "memory_bytes_per_rank": [1000 + s - r for r in range(stages * replicas * tensor)],
                **(records[s] if records else {}),
            },
        )
    write_timelines(path, sim.events, Layout(replicas, stages, tensor), steps=steps)
    write_summary(path, {"status": "complete", "steps": steps})
    return path


def write_timelines(path: Path, step_events, layout: Layout, *, steps: int, first: int = 1) -> None:
    """Every rank's timeline file: the same simulated step, repeated for each step ``first``..``steps`` (a stage's
    tensor ranks alike)."""
    for rank in range(layout.world):
        stage, replica = layout.stage(rank), layout.replica(rank)
        events = []
        for s in range(first - 1, steps):
            for e in step_events:
                if e.stage == stage:
                    events.append(
                        type(e)(
                            e.stage, e.phase, e.batch_slice, e.token_slice, e.start_s, e.end_s, rank, replica, s + 1
                        )
                    )
        write_timeline(timeline_path(path, rank), events, source="measured", rank=rank, stage=stage)


def assert_nontrivial_png(path: Path) -> None:
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    img = matplotlib.image.imread(path)
    assert img.shape[0] > 200 and img.shape[1] > 400, img.shape
    # Not blank: many distinct colours (boxes, hatching, text), not a flat image. Each pixel's RGB as one integer: a
    # unique of those is a hundred times faster than one over rows of three (axis=0).
    rgb = (img[..., :3] * 255).astype(np.uint8).astype(np.uint32)
    colours = np.unique((rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2])
    assert len(colours) > 50, len(colours)


def assert_chrome_trace(trace: dict, ranks_per_run: dict[str, int]) -> None:
    """Valid Chrome trace JSON: X events with µs times, one named process per rank of each run."""
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    for label, ranks in ranks_per_run.items():
        mine = sorted(n for n in names.values() if n.startswith(label + " · rank "))
        assert mine == [f"{label} · rank {r} (stage {r % 2}, replica {r // 2})" for r in range(ranks)], names
    assert len(names) == sum(ranks_per_run.values())
    xs = [e for e in events if e["ph"] == "X"]
    assert xs and all(e["pid"] in names and e["dur"] >= 0 and e["ts"] >= 0 for e in xs)
    assert {e["cat"] for e in xs} == {"forward", "backward", "step"}


TERAPIPE = [(1, [8, 8, 8, 8])]  # a run's scheme
GPIPE = [(1, [SEQ])]  # its baseline's


def checkpointed_run(path: Path, model=None, *, stages: int = 2, step: int = 3, seed: int = 1, data: str | None = None):
    """`make_run`'s folder with a complete checkpoint of ``step``: the stages of ``build_model(model, seed=seed)``
    (random weights, not trained) saved as the workers save them; ``data``: the data file its arguments name."""
    import json

    from terapipe_cli.models import build_model
    from terapipe_cli.train import checkpoint

    model = model or tiny_model(seq_len=SEQ)
    make_run(path, TERAPIPE, stages=stages, steps=step, model=model)
    if data is not None:
        config = json.loads((path / "config.json").read_text())
        config["arguments"]["data"] = data
        (path / "config.json").write_text(json.dumps(config))
    whole = build_model(model, seed=seed).state_dict()
    for k in range(stages):
        names = build_model(model, k, stages).state_dict()
        checkpoint.save_stage(path, step, k, stages, {n: whole[n] for n in names}, {})
    checkpoint.mark_complete(path, step, stages)
    return path


def resumed_run(path: Path, *, slices=((1, [16, 16]),), stages: int = 4, saved: int = 3, steps: int = 6) -> Path:
    """A run resumed under another plan as `terapipe train --resume --out PATH --plan NEW --steps STEPS` leaves it:
    `checkpointed_run`'s steps 1..``saved`` under K = 2, the launcher's own preparation of the resume under a plan
    of ``stages`` stages over ``slices`` (`prepare_run`), then the steps after ``saved`` as its workers write them
    (metrics, the new ranks' timelines, the summary)."""
    from terapipe_cli.config.run import RunConfig
    from terapipe_cli.files import write_json_atomic
    from terapipe_cli.train.prepare import prepare_run

    checkpointed_run(path, step=saved)
    model = tiny_model(seq_len=SEQ)
    plan = make_plan_dict(
        model=model, stages=stages, batch_size=1, seq_len=SEQ, token_step=1, slices=slices, predicted_s=0.05
    )
    write_json_atomic(path.parent / f"{path.name}-new-plan.json", plan)
    config = RunConfig(out=str(path), plan=str(path.parent / f"{path.name}-new-plan.json"), steps=steps)
    prepare_run(config, resume=True)
    sim = simulate(Schedule.build(slices, stages), per_token_parts(0.01 / SEQ), step_s=0.002)
    for s in range(saved, steps):
        record = {"step": s + 1, "loss": 5.0 - 0.1 * s, "iteration_s": sim.latency_s, "memory_bytes": 2000 + s}
        record.update(tokens_per_s=SEQ / sim.latency_s, memory_bytes_per_rank=[2000 + s - r for r in range(stages)])
        append_metrics(path, record)
    write_timelines(path, sim.events, Layout(1, stages, 1), steps=steps, first=saved + 1)
    write_summary(path, {"status": "complete", "steps": steps})
    return path
