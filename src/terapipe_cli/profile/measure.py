"""Measure a profile on the local device (docs/design.md §3): the tiles of `profile.tiles` timed through the runtime's
own code path (`profile.timer`, or by T torchrun processes with tensor parallelism, `profile.tensor_parallel`), the
context term fitted, the link and the gradient all-reduce measured (`profile.comm`), assembled into a
``terapipe.profile/3`` and checked against tiles off its grids (`check_against`, `recheck_profile`).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from terapipe_cli.engine.hostmem import retain_freed_memory
from terapipe_cli.models import ModelConfig
from terapipe_cli.plan.costmodel import PROFILE_SCHEMA, CostModel, profile_from_dict
from terapipe_cli.profile.comm import (
    allreduce_processes,
    measure_allreduce,
    measure_both,
    measure_link,
    message_sizes,
)
from terapipe_cli.profile.ends import held_out_errors, time_ends
from terapipe_cli.profile.fit import RelErr, fit_context
from terapipe_cli.profile.probe import DTYPE_BYTES, check_fits_in_memory, device_info
from terapipe_cli.profile.tensor_parallel import time_layer_tensor_parallel
from terapipe_cli.profile.tiles import Point, Settings, Tiles, check_points
from terapipe_cli.profile.timer import (
    CLOCK_NAMES,
    Progress,
    TileTimer,
    Timings,
    one_thread_per_stage,
    time_layer,
    time_points,
)
from terapipe_cli.units import utc_timestamp


def measure_profile(
    model: ModelConfig,
    settings: Settings,
    device: torch.device,
    *,
    progress: Progress | None = None,
    measure_comm: bool = True,
    measure_allreduce: bool = True,
    tensor_parallel: int = 1,
) -> dict:
    """Measure everything and return a ``terapipe.profile/3`` dict (validated before it is returned).
    ``measure_comm`` / ``measure_allreduce`` False: skip the stage-to-stage link (recorded as free) / the
    data-parallel all-reduce (no ``data_parallel_link``: plans with replicas leave it unpriced).
    ``tensor_parallel`` T > 1: the layer is timed as one of a stage's T tensor ranks, by T torchrun processes
    (`profile.tensor_parallel`); the rest is measured here, as for T = 1."""

    check_fits_in_memory(model, max(settings.batch_sizes), device)
    retain_freed_memory()  # the allocator training's workers use (engine/hostmem.py)
    started = time.perf_counter()
    tiles = settings.tiles(model.seq_len)
    # With T > 1 the ends too are timed by the T ranks: the runtime splits them by vocabulary rows (engine/tensor.py).
    if tensor_parallel > 1:
        timings, layer, ends = time_layer_tensor_parallel(model, settings, tiles, device, tensor_parallel, progress)
    else:
        timings, layer = time_layer(model, settings, tiles, device, progress)
        ends = time_ends(model, settings, device, progress)
    tables = _grid_tables(timings, settings)
    context = {which: _context_fit(timings, tiles, which) for which in ("forward", "backward")}
    params = layer["params"]  # one tensor rank's share with T > 1: what each device all-reduces over replicas
    comm, dp_link = _links(model, params, settings, device, progress, link=measure_comm, allreduce=measure_allreduce)
    rows = dict(zip(timings.points, timings.rows(), strict=True))
    profile = {
        "schema": PROFILE_SCHEMA,
        "source": "measured",
        "note": (
            f"Measured by `terapipe profile{' --quick' if settings.quick else ''}` through the runtime's StageRunner "
            f"(one decoder layer{_tensor_note(tensor_parallel)}) in {settings.precision}, median of "
            f"{settings.repeats} interleaved rounds. token_lengths is a geometric subset of the multiples of "
            "token_step; the cost model interpolates between them piecewise-linearly. backward_input_s and "
            "backward_weight_s: the backward of the same grid tiles split as the zero-bubble executor runs it "
            "(StageRunner.backward_input, then backward_weight), timed in the same visits."
        ),
        "created": utc_timestamp(),
        "device": dict(device_info(device), clock=CLOCK_NAMES[layer["clock"]], tensor_parallel=tensor_parallel),
        "model": model.to_dict(),
        "precision": settings.precision,
        "dtype_bytes": DTYPE_BYTES,
        "token_step": settings.token_step,
        "batch_sizes": list(settings.batch_sizes),
        "token_lengths": list(settings.token_lengths),
        "forward_s": tables["forward_s"],
        "backward_s": tables["backward_s"],
        "backward_input_s": tables["input_s"],
        "backward_weight_s": tables["weight_s"],
        "context": context,
        "ends": {k: v for k, v in ends.items() if k != "heldout"},
        "comm": comm,
        "optimizer_s_per_layer": layer["optimizer_s"],
        "activation_bytes_per_token_per_layer": layer["activation_bytes"],
        "params_per_layer": params,
        "vocab_parallel": True,  # the runtime splits the embedding and the head by vocabulary rows under T
        **dp_link,
        "grid": {
            "kind": "quick" if settings.quick else "default",
            "interpolation": "piecewise-linear in tokens, then in batch size (terapipe_cli.plan.costmodel)",
            "repeats": settings.repeats,
            **{f"{w}_{s}_s": tables[f"{w}_{s}_s"] for w in ("forward", "backward") for s in ("min", "max")},
            **{f"backward_{w}_{s}_s": tables[f"{w}_{s}_s"] for w in ("input", "weight") for s in ("min", "max")},
        },
        "context_points": [dict(rows[p], role=p.role) for p in tiles.context],
        "activation_method": layer["activation_method"],
        "seconds_to_measure": round(time.perf_counter() - started, 1),
    }
    checked = profile_from_dict(profile, "measured profile")  # the one validating reader accepts what we write
    profile["ends"]["heldout"] = {"points": ends["heldout"], **held_out_errors(checked, ends["heldout"])}
    if tiles.check:
        profile["check"] = check_against(profile, [rows[p] for p in tiles.check])
    return profile


def _tensor_note(tensor_parallel: int) -> str:
    if tensor_parallel == 1:
        return ""
    return (
        f" as one of {tensor_parallel} tensor ranks: rank 0's times of {tensor_parallel} torchrun processes; the "
        "embedding and the head likewise, split by vocabulary rows"
    )


def _grid_tables(timings: Timings, settings: Settings) -> dict[str, list[list[float]]]:
    """The no-context tables [batch size][token length]: ``forward_s``/``backward_s`` and the split backward's
    ``input_s``/``weight_s`` (medians), and their ``_min_s`` and ``_max_s``."""
    tables = {}
    for which in ("forward", "backward", "input", "weight"):
        for stat, suffix in enumerate(("s", "min_s", "max_s")):
            value = timings.by_point(which, stat)
            tables[f"{which}_{suffix}"] = [
                [float(value[Point(b, n, 0, "grid")]) for n in settings.token_lengths] for b in settings.batch_sizes
            ]
    return tables


def _context_fit(timings: Timings, tiles: Tiles, which: str) -> dict:
    """Fit the context term of the ``which`` ("forward" or "backward") pass and report it on held-out tiles."""
    median = timings.by_point(which)
    t_nc = {(p.b, p.i): median[p] for p in tiles.grid}
    fit_pts = [p for p in tiles.context if p.role == "fit"]
    held = [p for p in tiles.context if p.role == "heldout"]
    b, i, j = (np.array([getattr(p, a) for p in fit_pts], dtype=float) for a in "bij")
    fit = fit_context(b, i, j, [t_nc[(p.b, p.i)] for p in fit_pts], np.array([median[p] for p in fit_pts]))
    held_err = _fit_report(fit, held, t_nc, np.array([median[p] for p in held]))
    return {
        "coef": list(fit.coef),
        # Relative error of the predicted per-layer tile time t_nc + t_ctx on the held-out tiles: the
        # quantity the planner adds up. The context term alone, a difference of two timings, is below.
        "heldout_rel_err_mean": held_err["tile"].mean,
        "heldout_rel_err_max": held_err["tile"].max,
        "heldout_points": held_err["tile"].count,
        "heldout_context_only_rel_err_mean": held_err["context_only"].mean,
        "heldout_context_only_rel_err_max": held_err["context_only"].max,
        "fit_rel_err_mean": fit.fit_err.mean,
        "fit_rel_err_max": fit.fit_err.max,
        "fit_points": fit.fit_err.count,
    }


def _fit_report(fit, pts: list[Point], t_nc: dict, t: np.ndarray) -> dict:
    b, i, j = (np.array([getattr(p, a) for p in pts], dtype=float) for a in "bij")
    nc = np.array([t_nc[(p.b, p.i)] for p in pts])
    return {"tile": fit.errors(b, i, j, nc, t), "context_only": fit.context_errors(b, i, j, nc, t)}


# What the profile records with --no-comm: the planner then prices the link as free.
_FREE_LINK = {"latency_s": 0.0, "bytes_per_s": 1e12, "method": "not measured (--no-comm): a free link"}


def _links(
    model: ModelConfig,
    params_per_layer: int,
    settings: Settings,
    device: torch.device,
    progress: Progress | None,
    *,
    link: bool,
    allreduce: bool,
) -> tuple[dict, dict]:
    """The profile's ``comm`` (the stage-to-stage link, measured with messages from the smallest to the largest
    tile's activation; free with ``link`` False) and its ``data_parallel_link`` (the all-reduce of fp32 gradient
    buffers from a sixteenth of one layer's to the whole model's), or ``data_parallel_link_skipped`` with the
    reason when not asked or when this machine has nothing to reduce across (one GPU). Both in one torchrun launch
    where they can be (`comm.measure_both`)."""
    H = model.hidden
    link_sizes = message_sizes(
        min(settings.batch_sizes) * settings.token_lengths[0] * H * DTYPE_BYTES,
        max(settings.batch_sizes) * model.seq_len * H * DTYPE_BYTES,
        settings.comm_sizes,
    )
    layer_bytes = params_per_layer * DTYPE_BYTES
    ar_sizes = message_sizes(layer_bytes // 16, model.layers * layer_bytes, settings.comm_sizes)
    replicas = allreduce_processes(device.type) if allreduce else None
    rounds = {"rounds": settings.comm_rounds, "iters": settings.comm_iters}
    what = [w for w, on in (("point-to-point link", link), (f"all-reduce over {replicas} processes", replicas)) if on]
    phase = f"{' and '.join(what)} (torchrun)"
    if what and progress:
        progress(phase, 0, 1)
    if link and replicas:
        measured_link, measured_ar = measure_both(device.type, link_sizes, ar_sizes, **rounds)
    else:
        measured_link = measure_link(device.type, link_sizes, **rounds) if link else None
        measured_ar = measure_allreduce(device.type, ar_sizes, replicas, **rounds) if replicas else None
    if what and progress:
        progress(phase, 1, 1)
    comm = measured_link.to_dict() if measured_link is not None else dict(_FREE_LINK)
    if measured_ar is not None:
        return comm, {"data_parallel_link": measured_ar.to_dict()}
    why = "not measured (--no-allreduce)" if not allreduce else "not measured: one GPU, no second device to reduce with"
    return comm, {"data_parallel_link_skipped": why}


# ----------------------------------------------------------------------------------------------- check


def check_against(profile: dict, measured: list[dict]) -> dict:
    """Compare the profile's tile cost with direct timings of tiles off its grids.

    The prediction is the profile's tile of one layer, what the check times: ``no_context(b, i) + context(b, i,
    j)`` of `CostModel` — not a pipeline stage's ``cost(b, i, j)``, whose slowest stage also holds the embedding or
    the LM head (with a large vocabulary, most of the stage's time) and the link.
    """
    prof = profile_from_dict(profile, "profile")
    cost = CostModel(prof, stages=prof.model.layers)
    rows = []
    for m in measured:
        predicted = float(cost.no_context(m["b"], m["i"]) + cost.context(m["b"], m["i"], m["j"]))
        total = m["forward_s"] + m["backward_s"]
        rows.append(dict(m, measured_s=total, predicted_s=predicted, rel_err=abs(predicted - total) / total))
    err = RelErr.of([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    return {"points": rows, "rel_err_mean": err.mean, "rel_err_max": err.max}


def recheck_profile(
    profile: dict,
    device: torch.device,
    *,
    count: int,
    repeats: int,
    seed: int = 0,
    clock: str | None = None,
    progress: Progress | None = None,
) -> dict:
    """Time ``count`` off-grid tiles now, on this device and at the profile's precision, and compare them with
    an existing profile.

    A few tiles ON the profile's grid are timed in the same rounds as a reference: their ratio to the
    profiled times is the machine's speed drift since the profile was taken (a shared CPU can be 10%
    slower minutes later), reported next to the check so that drift is not mistaken for model error.
    ``clock``: None uses the clock the profile was measured with.
    """
    prof = profile_from_dict(profile, "profile")
    model = prof.model
    if clock is None:
        clock = "wall" if prof.device.get("clock") == CLOCK_NAMES["wall"] else "cpu"
    pts = check_points(prof.batch_sizes, prof.token_lengths, model.seq_len, prof.token_step, count=count, seed=seed)
    lengths = prof.token_lengths
    refs = list(
        dict.fromkeys(
            Point(b, lengths[(k * (len(lengths) - 1)) // 3], 0, "reference")
            for b in prof.batch_sizes
            for k in (1, 2, 3)
        )
    )
    with one_thread_per_stage(device):
        timer = TileTimer(model, device, seed=seed, clock=clock, precision=prof.precision)
        with timer.runner.step():
            timings = time_points(
                timer,
                pts + refs,
                repeats=repeats,
                warmup_all=True,
                seed=seed,
                progress=progress,
                phase="timing check tiles",
            )
    measured = timings.rows()
    result = check_against(profile, measured[: len(pts)])
    ref = check_against(profile, measured[len(pts) :])
    drift = float(np.median([r["measured_s"] / r["predicted_s"] for r in ref["points"]]))
    result["reference"] = {"points": ref["points"], "speed_ratio": drift}
    # The same check with the drift divided out: what remains is the cost model's own error.
    adjusted = RelErr.of(
        [r["predicted_s"] * drift for r in result["points"]], [r["measured_s"] for r in result["points"]]
    )
    result["drift_adjusted_rel_err_mean"] = adjusted.mean
    result["drift_adjusted_rel_err_max"] = adjusted.max
    return result
