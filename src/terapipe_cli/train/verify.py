"""``--verify``: the same training on one process, whole model, whole batch — and the comparison.

The reference builds the full model from the same seed, takes the same batches (`data.step_batch`: the
global batch of B·D sequences), divides the summed token loss by all predicted tokens of the step and takes the
same update (`optim.take_step`: the same precision under autocast, lr schedule, fp16 loss scale, clipping by the
norm of the whole model, AdamW). It compares every step's loss, the gradients of the first step (the first one
not skipped, with fp16) after unscaling and clipping, and every weight after the last step.

A tensor's relative difference is norm-wise, ``‖a − b‖₂ / ‖b‖₂`` (the largest over all tensors is reported,
with the largest element-wise absolute difference). Element-wise relative measures are meaningless for weights
trained with Adam: its first updates are nearly ``lr · sign(g)``, so an element whose gradient is within
rounding noise of zero moves by up to ``lr`` in a direction set by that noise.

Tolerances from a measured spread. How far a correct run may drift depends on the model, the number of steps
and the precision, so no fixed number serves every run. A second single-process run differs from the reference
only in rounding — the *spread* — and each check's tolerance is ``max(floor, SPREAD_FACTOR × spread)``:

- fp32: the spread run is the reference in float64 (`model.double()`, no autocast): the reference's own rounding
  error. The pipelined run is another fp32 computation of the same numbers, so its difference from the fp32
  reference is of the same size.
- bf16/fp16: the spread run has the same precision and runs the run's own tiles — the plan's token and batch
  slices, every replica's — through the runtime's `StageRunner` as one stage of the whole model (the K/V context
  path, on one process). The same tile shapes call the same low-precision kernels, which round differently from
  one CPU to the next (an AVX512-bf16 CPU's dot products differ from another's) and differently from the whole
  sequence's: the spread then measures exactly the rounding the pipelined run has, on the machine it ran on, and
  the pipelined run differs from it only by where the stages are cut (a spread run of other slices can round
  a correct run's weights beyond the factor, docs/results.md). An fp32 spread run would measure the precision's
  own error instead, several times larger: a looser tolerance for nothing. A bug inside the K/V cache would be in
  both this spread run and the pipelined run; the fp32 verification, whose spread run is the whole sequence,
  catches it. The negative controls (the K/V hand-back
  dropped, a tensor-parallel all-reduce skipped) are faults of the pipelined run alone, so they still fail.

`SPREAD_FACTOR`, measured on CPU as run difference / spread (docs/design.md §6a has the table): at most 1.9 in
fp32 and 3.4 in bf16 (fp16: below 1) over the tiny model's scheme families (K = 2–3, D = 1–2) and the 6-layer,
H = 192, L = 512 model at K = 3 for 10 steps, with warm-up, cosine decay and clipping active; the negative
control (the K/V hand-back dropped) reached 19 at the least (a bf16 loss; its gradients 169). 10 leaves 3x room
above the drift and below every negative control. The floors keep fp32's fixed tolerances of the past (1e-5 on
the loss, 1e-4 on tensors) as the least a check allows.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from terapipe_cli.config.run import LRSchedule
from terapipe_cli.engine.data import step_batch, step_documents
from terapipe_cli.engine.loss import token_loss_sum
from terapipe_cli.engine.optim import LossScale, make_optimizer, set_lr, take_step
from terapipe_cli.engine.stage import AUTOCAST_DTYPES, StageRunner
from terapipe_cli.models import build_model
from terapipe_cli.models.attention import DocumentMask
from terapipe_cli.plan.file import Plan
from terapipe_cli.schedule.schedule import plan_tiles
from terapipe_cli.train import checkpoint
from terapipe_cli.train.init_from import initial_weights
from terapipe_cli.train.prepare import PreparedRun
from terapipe_cli.train.rundir import read_metrics, read_summary, verify_grads_path, write_summary

# The tolerance of a check is max(floor, SPREAD_FACTOR x the spread run's difference from the reference).
LOSS_FLOOR = 1e-5  # relative, every step's loss
TENSOR_FLOOR = 1e-4  # norm-wise relative, every gradient and weight tensor
SPREAD_FACTOR = 10.0


@dataclass
class Trajectory:
    """One single-process training: its loss per step, its gradients (unscaled, clipped) at ``grads_step`` —
    the first step not skipped — and its weights after the last step, by name, on the CPU."""

    losses: list[float] = field(default_factory=list)
    grads_step: int | None = None
    grads: dict = field(default_factory=dict)
    weights: dict = field(default_factory=dict)


@dataclass
class Check:
    what: str
    max_abs: float  # the run against the reference
    max_rel: float
    spread: float  # the spread run against the reference: the same measure
    tolerance: float
    worst: str = ""  # the step or parameter with the run's largest relative difference

    @property
    def ok(self) -> bool:
        return self.max_rel <= self.tolerance


@dataclass
class Verification:
    precision: str
    spread_run: str  # what the spread run was, in words
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "precision": self.precision,
            "spread_run": self.spread_run,
            "spread_factor": SPREAD_FACTOR,
            "checks": [
                {
                    "what": c.what,
                    "max_abs": c.max_abs,
                    "max_rel": c.max_rel,
                    "spread": c.spread,
                    "tolerance": c.tolerance,
                    "worst": c.worst,
                    "ok": c.ok,
                }
                for c in self.checks
            ],
        }


StepsDone = Callable[[int], None]  # told the steps a single-process run has done
Progress = Callable[[str, float, float], None]  # (phase, done, total), as `profile.timer.Progress`

# One step's forward and backward on a single process: (model, batch (n, L + 1), loss multiplier, document starts
# (n, L) on the CPU or None) -> the summed token loss (a float). The backward leaves the gradient of multiplier x that
# sum in .grad.
StepFn = Callable[[torch.nn.Module, torch.Tensor, float, torch.Tensor | None], float]


def whole_sequence_step(precision: str) -> StepFn:
    """The plain model on the whole batch and sequence at once, under the precision's autocast (with packed
    documents, the same block-causal mask over the whole sequence)."""
    dtype = AUTOCAST_DTYPES[precision]

    def step(model: torch.nn.Module, batch: torch.Tensor, multiplier: float, documents: torch.Tensor | None) -> float:
        device = batch.device.type
        docs = None if documents is None else DocumentMask.of(documents, 0, batch.device)
        with torch.autocast(device, dtype=dtype) if dtype is not None else nullcontext():
            loss = token_loss_sum(model(batch[:, :-1], docs=docs), batch[:, 1:])
        (loss * multiplier).backward()
        return loss.item()

    return step


def tiled_step(runner: StageRunner, plan: Plan, replicas: int) -> StepFn:
    """The whole model as one `StageRunner` stage walking the plan's own tiles — every batch slice and token slice
    of each of the ``replicas`` replicas' B sequences — forwards in order, backwards in reverse (the runtime's own
    K/V context path and tile shapes, on one process)."""
    tiles = plan_tiles(plan.slices)

    def step(model: torch.nn.Module, batch: torch.Tensor, multiplier: float, documents: torch.Tensor | None) -> float:
        runner.set_loss_scale(multiplier)
        total = 0.0
        with runner.step():
            for replica in range(replicas):
                own = slice(replica * plan.batch_size, (replica + 1) * plan.batch_size)
                rows, doc_rows = batch[own], None if documents is None else documents[own]
                for t in tiles:
                    b, j = slice(t.batch_start, t.batch_start + t.batch_size), t.token_start
                    x, y = rows[b, j : j + t.tokens], rows[b, j + 1 : j + t.tokens + 1]
                    docs = None if doc_rows is None else doc_rows[b, j : j + t.tokens]
                    total += runner.forward_tile(t.batch_slice, t.token_slice, x, y, doc_starts=docs).item()
                for t in reversed(tiles):
                    runner.backward_tile(t.batch_slice, t.token_slice, None)
        return total

    return step


def single_process_run(
    run, model: torch.nn.Module, step_fn: StepFn, precision: str, progress: StepsDone | None = None
) -> Trajectory:
    """Train ``model`` (the whole model, on the run's device) as the run did, one process, the global batch.
    ``run``: a `prepare.PreparedRun`, or anything with its plan, args, data and device; ``progress``: told the steps
    done after each."""
    plan, args = run.plan, run.args
    optimizer = make_optimizer(model, args.lr, args.optimizer)
    schedule = LRSchedule.of_run(args)
    loss_scale = LossScale() if precision == "fp16" else None
    params = list(model.parameters())
    sequences, L, eos = plan.batch_size * args.data_parallel, plan.seq_len, args.eos_id
    out = Trajectory()
    for step in range(1, args.steps + 1):
        draw = dict(seed=args.seed, step=step, sequences=sequences, seq_len=L, sampling=args.sampling)
        batch = step_batch(run.data, **draw)
        documents = step_documents(run.data, eos=eos, **draw) if args.document_mask else None
        set_lr(optimizer, schedule(step))
        optimizer.zero_grad(set_to_none=True)
        scale = loss_scale.scale if loss_scale is not None else 1.0
        out.losses.append(step_fn(model, batch.to(run.device), scale / (sequences * L), documents) / (sequences * L))
        update = take_step(optimizer, params, max_norm=args.grad_clip, loss_scale=loss_scale)
        if out.grads_step is None and not update.skipped:
            out.grads_step = step
            named = model.named_parameters(remove_duplicate=False)  # a tied matrix under both names, as the stages
            out.grads = {n: p.grad.detach().cpu().clone() for n, p in named}
        if progress is not None:
            progress(step)
    # The state dict's names, as the run's checkpoints hold them (a tied head's matrix under both of its names).
    out.weights = {n: p.detach().cpu().clone() for n, p in model.state_dict().items()}
    return out


def starting_model(run) -> torch.nn.Module:
    """The whole model as the run starts: the seed's weights, or ``--init-from``'s (`init_from.initial_weights`)."""
    model = build_model(run.plan.model, seed=run.args.seed)
    initial_weights(run.args, model)
    return model.to(run.device)


def reference_run(run, progress: StepsDone | None = None) -> Trajectory:
    """The reference: the whole model at the run's precision, the whole sequence at once."""
    model = starting_model(run)
    precision = run.args.precision
    return single_process_run(run, model, whole_sequence_step(precision), precision, progress)


def spread_run(run, progress: StepsDone | None = None) -> tuple[Trajectory, str]:
    """The run whose difference from the reference is the spread (the module docstring says why this one)."""
    plan, args, precision = run.plan, run.args, run.args.precision
    if precision == "fp32":
        model = starting_model(run).double()
        return single_process_run(run, model, whole_sequence_step("fp32"), "fp32", progress), "float64, whole sequence"
    chunk = args.loss_chunk_tokens if args.loss_chunk_tokens is not None else plan.loss_chunk_tokens
    runner = StageRunner(
        plan.model, 0, 1, seed=args.seed, device=run.device, precision=precision, loss_chunk_tokens=chunk
    )
    initial_weights(args, runner.module)
    step_fn = tiled_step(runner, plan, args.data_parallel)
    trajectory = single_process_run(run, runner.module, step_fn, precision, progress)
    return trajectory, f"{precision}, the run's own tiles on one process"


def pipelined_run(prepared: PreparedRun) -> Trajectory:
    """What the finished run in ``prepared.launch.run_dir`` recorded."""
    run_dir, plan, steps = prepared.launch.run_dir, prepared.plan, prepared.args.steps
    out = Trajectory(losses=[r["loss"] for r in sorted(read_metrics(run_dir), key=lambda r: r["step"])])
    for k in range(plan.stages):
        path = verify_grads_path(run_dir, k)
        if path.exists():
            saved = torch.load(path, weights_only=True)
            out.grads_step = saved["step"]
            out.grads.update(saved["grads"])
    if checkpoint.latest_complete(run_dir) == steps:
        for k in range(plan.stages):
            out.weights.update(checkpoint.load_stage(run_dir, steps, k)["model"])
    return out


def verify_run(prepared: PreparedRun, progress: Progress | None = None) -> Verification:
    """Compare the finished run with the reference, with tolerances from the spread run."""
    return verify_trajectory(pipelined_run(prepared), prepared, progress)


SingleProcessRuns = tuple[Trajectory, Trajectory, str]  # the reference, the spread run, what the spread run was


def single_process_runs(setup, progress: Progress | None = None) -> SingleProcessRuns:
    """The reference and the spread run of ``setup`` (a `prepare.PreparedRun`, or anything with its plan, args, data
    and device); ``progress(phase, steps done, steps)`` follows them."""
    steps = setup.args.steps

    def phase(name: str) -> StepsDone | None:
        return None if progress is None else lambda done: progress(name, done, steps)

    ref = reference_run(setup, phase("reference (one process)"))
    alt, spread_what = spread_run(setup, phase("spread run (one process)"))
    return ref, alt, spread_what


def verify_trajectory(
    run: Trajectory, setup, progress: Progress | None = None, runs: SingleProcessRuns | None = None
) -> Verification:
    """Compare a pipelined run's ``run`` with the reference of ``setup`` (a `prepare.PreparedRun`, or anything with
    its plan, args, data and device), with tolerances from the spread run; ``progress(phase, steps done, steps)``
    follows the two single-process runs. ``runs``: those two runs (`single_process_runs`), when already done."""
    steps = setup.args.steps
    ref, alt, spread_what = runs if runs is not None else single_process_runs(setup, progress)
    loss, loss_spread = _compare_losses(run.losses, ref.losses), _compare_losses(alt.losses, ref.losses)
    grads, grads_spread = _compare(run.grads, ref.grads), _compare(alt.grads, ref.grads)
    if run.grads_step != ref.grads_step:
        grads = (float("inf"), float("inf"), f"step {run.grads_step} vs the reference's {ref.grads_step}")
    weights, weights_spread = _compare(run.weights, ref.weights), _compare(alt.weights, ref.weights)
    return Verification(
        setup.args.precision,
        spread_what,
        [
            _check(f"loss, {steps} steps", loss, loss_spread, LOSS_FLOOR),
            _check(f"gradients at step {ref.grads_step}", grads, grads_spread, TENSOR_FLOOR),
            _check(f"weights after step {steps}", weights, weights_spread, TENSOR_FLOOR),
        ],
    )


def verify_and_record(prepared: PreparedRun, progress: Progress | None = None) -> Verification:
    """`verify_run`, its result added to the run's summary.json under "verify"."""
    result = verify_run(prepared, progress)
    run_dir = prepared.launch.run_dir
    summary = read_summary(run_dir)
    summary.pop("schema", None)
    write_summary(run_dir, {**summary, "verify": result.to_dict()})
    return result


Difference = tuple[float, float, str]  # (largest relative, largest absolute, where the largest relative is)


def _check(what: str, run: Difference, spread: Difference, floor: float) -> Check:
    tolerance = max(floor, SPREAD_FACTOR * spread[0])
    return Check(what, max_abs=run[1], max_rel=run[0], spread=spread[0], tolerance=tolerance, worst=run[2])


def _compare_losses(losses: list[float], ref_losses: list[float]) -> Difference:
    """Every step's loss against the reference; a missing or NaN loss counts as infinitely far off."""
    rows = []  # (relative, absolute, step)
    for step, ref in enumerate(ref_losses, 1):
        diff = abs(losses[step - 1] - ref) if step <= len(losses) else float("nan")
        diff = diff if diff == diff else float("inf")
        rows.append((diff / max(abs(ref), 1e-30), diff, step))
    max_rel, _, worst_step = max(rows)
    return max_rel, max(r[1] for r in rows), f"step {worst_step}"


def _compare(got: dict, ref: dict) -> Difference:
    """Tensors by name: the largest norm-wise relative difference, and the largest absolute one (NaN: inf)."""
    if set(got) != set(ref):
        missing = sorted(set(ref) ^ set(got))
        return float("inf"), float("inf"), f"names differ: {missing[:3]}"
    worst, max_abs, max_rel = "", 0.0, 0.0
    for name, r in ref.items():
        delta = got[name].double() - r.double()
        rel = delta.norm().item() / max(r.double().norm().item(), 1e-30)
        rel = rel if rel == rel else float("inf")
        max_abs = max(max_abs, delta.abs().max().item())
        if rel >= max_rel:
            worst, max_rel = name, rel
    return max_rel, max_abs, worst
