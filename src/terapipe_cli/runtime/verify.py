"""``--verify``: the same training on one process, whole model, whole batch — and the comparison.

The reference builds the full model from the same seed, takes the same batches (`data.step_batch`: the
global batch of B·D sequences), divides the summed token loss by all predicted tokens of the step and takes
the same AdamW steps. The pipelined run must match it within fp32 tolerances (docs/design.md §6): relative 1e-5 on
every step's loss, 1e-4 on every parameter's gradient at step 1 and on every weight after the last step.

A tensor's relative difference is norm-wise, ``‖a − b‖₂ / ‖b‖₂`` (the largest over all tensors is reported,
with the largest element-wise absolute difference). Element-wise relative measures are meaningless for
weights trained with Adam: its first updates are nearly ``lr · sign(g)``, so an element whose gradient is
within rounding noise of zero moves by up to ``lr`` in a direction set by that noise. Measured on the tiny
model (H = 256, L = 1024, 5 steps at lr 1e-3): the fp32 single-process reference itself differs from an fp64
run by 3e-3 in ``max|Δw| / max|w|`` while the pipelined run differs from fp64 by 1.6e-3; norm-wise, both are
far below 1e-4. A real error (e.g. the dropped K/V gradient hand-back) moves whole tensors and fails it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from terapipe_cli.model import GPT, token_loss_sum
from terapipe_cli.runtime import checkpoint
from terapipe_cli.runtime.data import step_batch
from terapipe_cli.runtime.optim import make_optimizer, set_lr
from terapipe_cli.runtime.prepare import PreparedRun
from terapipe_cli.runtime.rundir import read_metrics, read_summary, verify_grads_path, write_summary

LOSS_RTOL = 1e-5
TENSOR_RTOL = 1e-4


@dataclass
class Check:
    what: str
    max_abs: float
    max_rel: float
    tolerance: float
    worst: str = ""  # the step or parameter with the largest relative difference

    @property
    def ok(self) -> bool:
        return self.max_rel <= self.tolerance


@dataclass
class Verification:
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "checks": [
                {
                    "what": c.what,
                    "max_abs": c.max_abs,
                    "max_rel": c.max_rel,
                    "tolerance": c.tolerance,
                    "worst": c.worst,
                    "ok": c.ok,
                }
                for c in self.checks
            ],
        }


def reference_run(prepared: PreparedRun) -> tuple[list[float], dict, dict]:
    """(loss per step, gradients at step 1, final weights), by name, from the single-process reference."""
    plan, args = prepared.plan, prepared.args
    model = GPT(plan.model, seed=args.seed).to(prepared.device)
    optimizer = make_optimizer(model, args.lr)
    sequences, L = plan.batch_size * args.data_parallel, plan.seq_len
    losses: list[float] = []
    grads1: dict = {}
    for step in range(1, args.steps + 1):
        batch = step_batch(prepared.data, seed=args.seed, step=step, sequences=sequences, seq_len=L)
        batch = batch.to(prepared.device)
        set_lr(optimizer, args.lr)
        optimizer.zero_grad(set_to_none=True)
        logits = model(batch[:, :-1])
        loss = token_loss_sum(logits, batch[:, 1:]) / (sequences * L)
        loss.backward()
        losses.append(loss.item())
        if step == 1:
            grads1 = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
        optimizer.step()
    weights = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return losses, grads1, weights


def verify_run(prepared: PreparedRun) -> Verification:
    """Compare the finished run in ``prepared.launch.run_dir`` with the reference."""
    run_dir, plan, steps = prepared.launch.run_dir, prepared.plan, prepared.args.steps
    ref_losses, ref_grads, ref_weights = reference_run(prepared)
    grads: dict = {}
    for k in range(plan.stages):
        grads.update(torch.load(verify_grads_path(run_dir, k), weights_only=True))
    last = checkpoint.latest_complete(run_dir)
    weights: dict = {}
    if last == steps:
        for k in range(plan.stages):
            weights.update(checkpoint.load_stage(run_dir, last, k)["model"])
    return Verification(
        [
            _compare_losses(f"loss, {steps} steps", read_metrics(run_dir), ref_losses),
            _compare("gradients at step 1", grads, ref_grads),
            _compare(f"weights after step {steps}", weights, ref_weights),
        ]
    )


def verify_and_record(prepared: PreparedRun) -> Verification:
    """`verify_run`, its result added to the run's summary.json under "verify"."""
    result = verify_run(prepared)
    run_dir = prepared.launch.run_dir
    summary = read_summary(run_dir)
    summary.pop("schema", None)
    write_summary(run_dir, {**summary, "verify": result.to_dict()})
    return result


def _compare_losses(what: str, metrics: list[dict], ref_losses: list[float]) -> Check:
    """Every step's loss against the reference; a missing or NaN loss counts as infinitely far off."""
    run_losses = {r["step"]: r["loss"] for r in metrics}
    rows = []  # (relative, absolute, step)
    for step, ref in enumerate(ref_losses, 1):
        diff = abs(run_losses.get(step, float("nan")) - ref)
        diff = diff if diff == diff else float("inf")
        rows.append((diff / max(abs(ref), 1e-30), diff, step))
    max_rel, _, worst_step = max(rows)
    return Check(what, max(r[1] for r in rows), max_rel, LOSS_RTOL, f"step {worst_step}")


def _compare(what: str, got: dict, ref: dict) -> Check:
    """Tensors by name: the largest norm-wise relative difference, and the largest absolute one."""
    if set(got) != set(ref):
        missing = sorted(set(ref) ^ set(got))
        return Check(what, float("inf"), float("inf"), TENSOR_RTOL, f"names differ: {missing[:3]}")
    worst, max_abs, max_rel = "", 0.0, 0.0
    for name, r in ref.items():
        delta = got[name].double() - r.double()
        max_abs = max(max_abs, delta.abs().max().item())
        rel = delta.norm().item() / max(r.double().norm().item(), 1e-30)
        if rel >= max_rel:
            worst, max_rel = name, rel
    return Check(what, max_abs, max_rel, TENSOR_RTOL, worst)
