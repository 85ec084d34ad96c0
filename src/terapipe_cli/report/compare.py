"""The numbers of the report: a run against its baseline, from their run directories alone. No torch, no I/O.

Every number here is recomputable from the run directories (the tests do so):

* latency: ``iteration_s`` of ``metrics.jsonl`` over the steps after the warm-up (median, mean ± std, min–max);
  speed-up = baseline median / run median; tokens/s = tokens per step / median latency;
* busy and idle per stage and the bubble fraction over all compared steps and replicas, from the timelines, as
  `timeline.stage_times` defines them (the simulator's predicted step is read by the same function), next to
  the formula ``(K−1)/(v·M+K−1)`` (M tiles on K stages of v chunks, equal tiles, free transfers);
* model TFLOP/s per device and MFU of the median step (``model_tflops``, ``mfu``: `plan.mfu`, the plan's count);
* predicted vs measured: the plan's ``predicted_s`` (the objective of docs/design.md §4) and, when a cost model
  is at hand, the schedule simulator's latency, each with ``(predicted − measured) / measured`` against the
  median;
* memory per stage: the plan's estimate (`terapipe_cli.plan.memory`) next to the largest a stage's ranks
  measured over the compared steps: what it kept for the backward (``saved_bytes_per_rank``, counted by the
  runtime's saved-tensor hooks) and the process's peak (``memory_bytes_per_rank``); on a CPU also the most bytes
  live during the first step the run's launch tracked (``live_bytes_per_rank``, whatever the warm-up) against the
  estimate less the state (what is kept for the backward and the transients on top).

The report file (schema ``terapipe.report/1``, `compare` builds it, `report.build` adds ``files`` and ``created``):
``warmup_steps``, ``model``, ``run`` and ``baseline`` (each: path, slices, tiles, latency statistics, tokens/s,
predicted and simulated latency with their errors, busy and idle per stage, the bubble measured / simulated /
formula, peak memory, losses), ``speedup.{median, mean, predicted, simulated}``, ``loss`` (the step-by-step
difference and whether it is within the precision's tolerance: ``match``, ``max_rel_diff``), ``cost_model``
(``used``, and the profile's path, source and device, or ``why`` not), ``files``, ``created``. Without a
baseline, ``baseline``, ``speedup`` and ``loss`` are null.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from terapipe_cli.plan.mfu import utilisation
from terapipe_cli.plan.simulate import SimResult, compare_timelines
from terapipe_cli.report.runs import Run
from terapipe_cli.schedule.timeline import StageTimes, stage_times

REPORT_SCHEMA = "terapipe.report/1"

# Both runs are the same synchronous training, so their losses differ only by floating-point summation order
# (attention split over token slices, gradients summed per tile). docs/design.md §6 allows 1e-5 relative between a
# pipelined run and one device at one step; two pipelined runs may each be off by that, and a few dozen
# AdamW steps carry an early difference forward, hence the margin.
LOSS_RTOL = 1e-4


def latency_stats(values: Sequence[float]) -> dict:
    """Median, mean, standard deviation (sample; 0 for one value), min and max, in seconds."""
    v = [float(x) for x in values]
    if not v:
        raise ValueError("no values")
    return {
        "median": statistics.median(v),
        "mean": statistics.fmean(v),
        "std": statistics.stdev(v) if len(v) > 1 else 0.0,
        "min": min(v),
        "max": max(v),
        "n": len(v),
    }


def compared_steps(run: Run, warmup: int) -> list[int]:
    """The steps after the first ``warmup`` of those trained under the run's own plan (at least one is always
    left): a run resumed under another plan warms up again under its new one."""
    own = run.own_steps
    return own[warmup_left_out(run, warmup) :]


def warmup_left_out(run: Run, warmup: int) -> int:
    """The warm-up steps left out of the run's own plan's steps: ``warmup``, leaving at least one."""
    return min(warmup, len(run.own_steps) - 1)


def segments(run: Run, warmup: int) -> list[dict]:
    """Each plan the run trained under, in step order (one for a run never resumed under another plan): its
    steps, layout and scheme, and the median of its steps after ``warmup`` and its measured bubble, from its own
    timelines read under its own plan; an earlier plan that a run from before segments were kept did not record
    has its steps alone."""
    out = []
    for seg in run.earlier:
        entry = {"steps": [seg.first_step, seg.last_step], "short_form": None}
        if seg.plan is not None:
            steps = list(range(seg.first_step, seg.last_step + 1))
            steps = steps[min(warmup, len(steps) - 1) :]
            layout = seg.layout
            per_step = (
                sorted(
                    (e for rank, evs in seg.events.items() for e in evs
                     if e.step == s and layout.tensor_rank(rank) == 0 and layout.replica(rank) == r),
                    key=lambda e: (e.stage, e.start_s),
                )
                for s in steps for r in range(layout.data)
            )  # fmt: skip
            entry.update(
                _scheme(seg.plan, seg.args),
                latency_median_s=statistics.median(run.metric(s)["iteration_s"] for s in steps),
                bubble_fraction=stage_times(per_step, seg.plan.stages).bubble_fraction,
            )
        out.append(entry)
    steps = compared_steps(run, warmup)
    out.append(
        {
            "steps": [run.first_step, run.steps[-1]],
            **_scheme(run.plan, run.args),
            "latency_median_s": statistics.median(run.metric(s)["iteration_s"] for s in steps),
            "bubble_fraction": run_stage_times(run, steps).bubble_fraction,
        }
    )
    return out


def _scheme(plan, args) -> dict:
    return {
        "short_form": plan.short_form(),
        "stages": plan.stages,
        "data_parallel": args.data_parallel,
        "tensor_parallel": args.tensor_parallel,
        "virtual_stages": plan.virtual_stages,
        "order": plan.order,
    }


def representative_step(run: Run, steps: Sequence[int]) -> int:
    """The compared step whose latency is closest to their median (the earliest on a tie): the one to draw."""
    lat = [run.metric(s)["iteration_s"] for s in steps]
    med = statistics.median(lat)
    return min(steps, key=lambda s: (abs(run.metric(s)["iteration_s"] - med), s))


def bubble_formula(stages: int, tiles: int, virtual: int = 1) -> float:
    """The textbook bubble fraction (K−1)/(v·M+K−1) of M equal tiles on K stages of v chunks each (Narayanan et
    al. 2021, §2.2: interleaving shrinks the bubble by v; v = 1 is GPipe's (K−1)/(M+K−1))."""
    return (stages - 1) / (virtual * tiles + stages - 1)


def measured_utilisation(run: Run, median_s: float) -> dict:
    """Measured model TFLOP/s per device and MFU of the median step (`plan.mfu`, the count the plan predicts with;
    ``mfu`` null where the device's peak is unknown)."""
    plan = run.plan
    device = run.summary.get("device") or run.config.get("device")
    precision = run.summary.get("precision") or plan.precision
    u = utilisation(
        plan.model, seq_len=plan.seq_len, sequences=plan.batch_size, devices=run.stages * run.args.tensor_parallel,
        step_s=median_s, device=device if isinstance(device, str) else None, precision=precision,
    )  # fmt: skip
    return u.to_dict()


def run_stage_times(run: Run, steps: Sequence[int]) -> StageTimes:
    """Busy/idle per stage over the given steps and every replica of a run, from its timelines."""
    return stage_times(
        (run.step_events(s, replica=r) for s in steps for r in range(run.args.data_parallel)), run.stages
    )


def stage_max(run: Run, steps: Sequence[int], key: str) -> list[int] | None:
    """A per-rank metric (``key`` of metrics.jsonl) reduced to its stages: the largest over ``steps`` and each stage's
    ranks (every replica and tensor rank). None when a step lacks it (runs from before it was recorded)."""
    per_rank = [run.metric(s).get(key) for s in steps]
    if not all(isinstance(p, list) and len(p) == run.world_size for p in per_rank):
        return None
    out = [0] * run.stages
    for p in per_rank:
        for rank, value in enumerate(p):
            k = run.layout.stage(rank)
            out[k] = max(out[k], int(value))
    return out


def memory_per_stage(run: Run, steps: Sequence[int]) -> list[dict]:
    """Per stage: the plan's estimate (None for a plan without one) and what the run measured over ``steps``,
    with the error of the estimate of what is kept for the backward: (estimated − measured) / measured; and the
    tracked live bytes of the run's tracked steps (any of its own, the warm-up's too) against the estimate less the
    state, with their error likewise."""
    estimate = run.plan.raw.get("memory") or {}

    def planned(key: str, k: int) -> float | None:
        values = estimate.get(key)
        return values[k] if isinstance(values, list) and len(values) == run.stages else None

    def error(est: float | None, measured: float | None) -> float | None:
        return (est - measured) / measured if est is not None and measured else None

    saved = stage_max(run, steps, "saved_bytes_per_rank")
    peak = stage_max(run, steps, "memory_bytes_per_rank")
    tracked = [s for s in run.own_steps if isinstance(run.metric(s).get("live_bytes_per_rank"), list)]
    live = stage_max(run, tracked, "live_bytes_per_rank") if tracked else None
    out = []
    for k in range(run.stages):
        est, measured = planned("activation_bytes", k), saved[k] if saved else None
        total, state = planned("per_stage_bytes", k), planned("state_bytes", k)
        est_live = total - state if total is not None and state is not None else None
        got_live = live[k] if live else None
        out.append(
            {
                "stage": k,
                "estimated_activation_bytes": est,
                "measured_saved_bytes": measured,
                "rel_err": error(est, measured),
                "estimated_live_bytes": est_live,
                "measured_live_bytes": got_live,
                "live_rel_err": error(est_live, got_live),
                "estimated_total_bytes": total,
                "measured_peak_bytes": peak[k] if peak else None,
            }
        )
    return out


def summarize(run: Run, label: str, warmup: int, sim: SimResult | None = None) -> dict:
    """Everything the report says about one run (its part of report.json)."""
    steps = compared_steps(run, warmup)
    lat = latency_stats([run.metric(s)["iteration_s"] for s in steps])
    times = run_stage_times(run, steps)
    rep = representative_step(run, steps)
    predicted = run.plan.predicted_s
    own = [run.metric(s) for s in run.own_steps]  # another plan's steps ran on other ranks
    per_rank = [r.get("memory_bytes_per_rank") for r in own]
    peak_per_rank = None
    if all(isinstance(p, list) and len(p) == run.world_size for p in per_rank):
        peak_per_rank = [max(int(p[k]) for p in per_rank) for k in range(run.world_size)]
    out = {
        "label": label,
        "path": str(run.path),
        "slices": [[b, list(lengths)] for b, lengths in run.plan.slices],
        "short_form": run.plan.short_form(),
        "stages": run.stages,
        "data_parallel": run.args.data_parallel,
        "tensor_parallel": run.args.tensor_parallel,
        "order": run.plan.order,
        "recompute": list(run.plan.recompute),
        "batch_size": run.plan.batch_size,
        "seq_len": run.plan.seq_len,
        "tiles": run.tiles,
        "tokens_per_step": run.tokens_per_step,
        "device": run.summary.get("device") or run.config.get("device"),
        "compared_steps": [steps[0], steps[-1]],
        "latency_s": lat,
        "tokens_per_s": run.tokens_per_step / lat["median"],
        "predicted_s": predicted,
        "predicted_rel_err": (predicted - lat["median"]) / lat["median"] if predicted else None,
        "simulated": None,
        **times.to_dict(),
        "bubble_formula": bubble_formula(run.stages, run.tiles, run.plan.virtual_stages),
        "virtual_stages": run.plan.virtual_stages,
        **measured_utilisation(run, lat["median"]),
        "peak_memory_bytes": max(int(r["memory_bytes"]) for r in own),
        "peak_memory_bytes_per_rank": peak_per_rank,
        "memory_per_stage": memory_per_stage(run, steps),
        "representative_step": rep,
        "segments": segments(run, warmup),
        "losses": [float(r["loss"]) for r in run.metrics],
    }
    if sim is not None:
        err = compare_timelines(sim.events, run.step_events(rep, replica=0))
        sim_times = sim.stage_times()
        out["simulated"] = {
            "latency_s": sim.latency_s,
            "rel_err": (sim.latency_s - lat["median"]) / lat["median"],
            "span_s": sim.compute_end_s,
            "span_rel_err_at_representative_step": err.rel_err,
            "action_rel_err_mean": err.action_rel_err_mean,
            "bubble_fraction": sim_times.bubble_fraction,
            # > 1: the tiles themselves ran slower than profiled (not the schedule): e.g. stages that compute at
            # the same time share cores or memory bandwidth with each other or with other processes.
            "busy_ratio": statistics.fmean(times.busy_s) / statistics.fmean(sim_times.busy_s),
        }
    return out


def compare_losses(run: Run, baseline: Run, rtol: float = LOSS_RTOL) -> dict:
    """Step-by-step loss difference of two runs of the same training (every step, warm-up included)."""
    a = [float(r["loss"]) for r in run.metrics]
    b = [float(r["loss"]) for r in baseline.metrics]
    n = min(len(a), len(b))
    abs_diff = [abs(x - y) for x, y in zip(a[:n], b[:n], strict=True)]
    rel_diff = [d / abs(y) if y else (0.0 if d == 0 else float("inf")) for d, y in zip(abs_diff, b[:n], strict=True)]
    worst = max(range(n), key=lambda s: rel_diff[s]) if n else 0
    return {
        "steps": n,
        "max_abs_diff": max(abs_diff, default=0.0),
        "max_rel_diff": max(rel_diff, default=0.0),
        "worst_step": worst + 1,
        "rel_tolerance": rtol,
        "match": n == len(a) == len(b) and max(rel_diff, default=0.0) <= rtol,
    }


def compare(
    run: Run,
    baseline: Run | None,
    *,
    warmup: int,
    sims: dict[str, SimResult] | None = None,
    cost_model: dict | None = None,
) -> dict:
    """The report object (schema ``terapipe.report/1``) without its ``files`` and ``created`` fields. Without a
    baseline (``terapipe report --no-baseline``) its ``baseline``, ``speedup`` and ``loss`` are null."""
    sims = sims or {}
    r = summarize(run, "TeraPipe", warmup, sims.get("run"))
    report = {
        "schema": REPORT_SCHEMA,
        "warmup_steps": warmup_left_out(run, warmup),
        "model": run.plan.model.name,
        "run": r,
        "baseline": None,
        "speedup": None,
        "loss": None,
        "cost_model": cost_model,
    }
    if baseline is not None:
        b = summarize(baseline, "GPipe" if _is_gpipe(baseline) else "baseline", warmup, sims.get("baseline"))
        report.update(baseline=b, speedup=speedup(r, b), loss=compare_losses(run, baseline))
    return report


def speedup(r: dict, b: dict) -> dict:
    """The baseline's times over the run's (> 1: the run is faster): measured, predicted, simulated."""
    return {
        "median": b["latency_s"]["median"] / r["latency_s"]["median"],
        "mean": b["latency_s"]["mean"] / r["latency_s"]["mean"],
        "predicted": (b["predicted_s"] / r["predicted_s"]) if r["predicted_s"] and b["predicted_s"] else None,
        "simulated": (b["simulated"]["latency_s"] / r["simulated"]["latency_s"])
        if r["simulated"] and b["simulated"]
        else None,
    }


def _is_gpipe(run: Run) -> bool:
    return all(lengths == [run.plan.seq_len] for _, lengths in run.plan.slices)
