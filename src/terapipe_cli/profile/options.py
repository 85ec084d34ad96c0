"""What `terapipe profile` was asked to do, checked before anything is measured (docs/design.md §8, §9).

Each function takes the command's options and returns what the library needs, or raises a one-line
`UserError` naming the option at fault: a bad request fails in a second, not after minutes of timing, and
no output file is written.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from terapipe_cli.config.device import default_precision, resolve_precision, runs_natively, same_device_name
from terapipe_cli.config.hardware import Hardware, load_hardware
from terapipe_cli.config.model import load_model_config
from terapipe_cli.errors import UserError
from terapipe_cli.files import check_output_file, read_user_text
from terapipe_cli.models import ModelConfig
from terapipe_cli.plan.costmodel import PROFILE_SCHEMAS, Profile, read_profile
from terapipe_cli.profile.analytic import analytic_profile
from terapipe_cli.profile.calibrate import Measurement, check_matches, combine, from_profile, read_tile_table
from terapipe_cli.profile.operator_table import OPERATORS_SCHEMA, operator_profile, read_operator_table
from terapipe_cli.profile.tiles import Settings

if TYPE_CHECKING:
    import torch

DEFAULT_BATCH_SIZES = "1,2,4"


def _probe():
    """The device probe (`profile.probe`) imports PyTorch: only the requests that time or check on a device load
    it, so `terapipe profile --analytic` and ``--calibrate`` run without it."""
    from terapipe_cli.profile import probe

    return probe


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> (1, 2, 4): positive integers, any order, duplicates folded."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        sizes = [int(p) for p in parts]
    except ValueError:
        raise UserError(
            f"must be a comma-separated list of positive integers, got {text!r}", where="--batch-sizes"
        ) from None
    if not sizes or any(b < 1 for b in sizes):
        raise UserError(f"must be a comma-separated list of positive integers, got {text!r}", where="--batch-sizes")
    return tuple(sorted(set(sizes)))


def check_writable(out: Path, force: bool = False) -> None:
    """Fail before minutes of measuring, not after: ``out`` must be a profile file we may write
    (`files.check_output_file`)."""

    check_output_file(out, kind="profile", schema=PROFILE_SCHEMAS, force=force, example="profile.json")


def model_to_profile(
    model: Path | None, batch_sizes: str | None, out: Path, force: bool = False
) -> tuple[ModelConfig, tuple[int, ...]]:
    """The model to profile, the batch sizes asked for (empty: the default), and a writable ``out``."""

    if model is None:
        raise UserError("is required (a model TOML such as configs/models/tiny.toml)", where="--model")
    cfg = load_model_config(model)
    sizes = parse_batch_sizes(batch_sizes) if batch_sizes is not None else ()
    check_writable(out, force)
    return cfg, sizes


def model_source(model: Path) -> str:
    """How ``--model`` named the model, for a profile to record (`Profile.model_argument`): a file or folder by its
    absolute path, a bundled model by its name."""
    return str(model.resolve()) if model.exists() else str(model)


def profile_to_check(
    path: Path, device: str, *, precision: str | None, model: Path | None, analytic: bool
) -> tuple[Profile, torch.device]:
    """For ``--check-profile``: the profile at ``path`` and the device to time it on. A measured profile is timed
    on the kind of device it was measured on; an analytic one only on the device and in the precision it
    describes (`check_analytic_device`), since its prediction is for that GPU; one made from an operator table
    (``operators``) likewise, on the device the table was timed on. An example profile (made-up
    numbers) predicts no device and is refused. The check times at the profile's precision; another
    ``--precision`` is refused, and so is T > 1 (the check times one process)."""

    if model is not None or analytic:
        raise UserError(
            "checks an existing profile; do not combine it with --model or --analytic", where="--check-profile"
        )
    prof = read_profile(path)
    if prof.source not in ("measured", "analytic", "operators"):
        raise UserError(
            f"is an {prof.source!r} profile; only a measured profile or an estimate (analytic, operators) can be "
            "checked by timing",
            where=str(path),
        )
    dev = _probe().resolve_device(device)
    measured = prof.source == "measured"
    if not measured:
        check_analytic_device(prof, dev, path)
    elif prof.device.get("kind") != dev.type:
        raise UserError(
            f"was measured on {prof.device.get('kind')!r}, but this check would time {dev.type!r} (see --device)",
            where=str(path),
        )
    T = prof.tensor_parallel
    if T > 1:
        todo = (
            "re-measure with --check instead"
            if measured
            else f"check its T = 1 estimate, or measure {T} ranks here with `terapipe profile --tensor-parallel {T} "
            "--check`"
        )
        raise UserError(
            f"{'was measured at' if measured else 'is an estimate for'} tensor parallelism {T}; --check-profile "
            f"times one process only ({todo})",
            where=str(path),
        )
    # Not given or auto: the profile's own (refused, like any bf16, on a GPU without bf16).
    asked = resolve_precision(prof.precision if precision in (None, "auto") else precision, dev.type)
    if asked != prof.precision:
        raise UserError(
            f"{asked} asked for, but {path} was {'measured' if measured else 'estimated'} in {prof.precision}; leave "
            "--precision out to check it at its own",
            where="--precision",
        )
    if not measured:  # a measured profile fitted here when it was made
        _probe().check_fits_in_memory(
            prof.model,
            max(prof.batch_sizes),
            dev,
            where=str(path),
            advice="check an estimate with smaller batch sizes (`terapipe profile --analytic --batch-sizes 1,2`)",
        )
    return prof, dev


def check_analytic_device(prof: Profile, dev: torch.device, path: Path) -> None:
    """An analytic profile is checked only where its prediction applies: the same kind of device, a device name
    that `device.same_device_name` matches (a hardware file's "NVIDIA H100-SXM5-80GB" and CUDA's
    "NVIDIA H100 80GB HBM3" both name an H100), and a precision this device computes natively."""

    kind, described = prof.device.get("kind"), str(prof.device.get("name"))
    local = _probe().device_info(dev)["name"]
    here = prof.precision if runs_natively(prof.precision, dev.type) else default_precision(dev.type)
    if kind == dev.type and same_device_name(described, local) and here == prof.precision:
        return
    what = "an analytic estimate" if prof.source == "analytic" else "an estimate from an operator table"
    raise UserError(
        f"is {what} for {described} ({kind}) in {prof.precision}, but this check would time "
        f"{local} ({dev.type}) in {here}; an estimate is checked only on the device and in the precision it "
        f"describes: make a measured profile of this machine with `terapipe profile --model {prof.model_argument} "
        "--check`",
        where=str(path),
    )


def analytic_request(
    cfg: ModelConfig,
    *,
    hardware: Path | None,
    tensor_parallel: int,
    batch_sizes: Sequence[int],
    token_step: int,
    check: bool,
    quick: bool,
    no_comm: bool,
    no_allreduce: bool = False,
    precision: str | None = None,
    operator_table: Path | None = None,
) -> dict:
    """For ``--analytic``: the estimated profile (`terapipe_cli.profile.analytic`); the flags about measuring
    this machine do not apply. ``precision`` None or auto: the hardware file's; another one is refused, since
    the file's peak FLOPs are for its own precision. With ``operator_table`` every kernel is priced from that table
    (`operator_table.operator_profile`), in its precision, and ``hardware`` is optional."""

    if check or quick or no_comm or no_allreduce:
        flag = "--check" if check else "--quick" if quick else "--no-comm" if no_comm else "--no-allreduce"
        raise UserError("applies to measuring this machine, not to --analytic", where=flag)
    kwargs: dict = {"tensor_parallel": tensor_parallel, "token_step": token_step}
    if batch_sizes:
        kwargs["batch_sizes"] = tuple(batch_sizes)
    if operator_table is not None:
        table = read_operator_table(operator_table)
        if precision not in (None, "auto") and precision != table.precision:
            raise UserError(
                f"must be {table.precision} with {operator_table}: the table was timed in it, got {precision!r}",
                where="--precision",
            )
        hw = None if hardware is None else load_hardware(hardware)
        return operator_profile(cfg, table, hw, **kwargs)
    if hardware is None:
        raise UserError(
            "is required with --analytic (a hardware TOML such as configs/hardware/v100.toml)", where="--hardware"
        )
    hw = load_hardware(hardware)
    if precision not in (None, "auto") and precision != hw.training.dtype:
        raise UserError(
            f"must be {hw.training.dtype} with {hardware}: its peak_flops is the {hw.training.dtype} peak "
            f"(a hardware file prices one precision), got {precision!r}",
            where="--precision",
        )
    return analytic_profile(cfg, hw, **kwargs)


def operators_request(
    device: str, precision: str | None, quick: bool, out: Path, *, others: dict[str, bool], force: bool = False
):
    """For ``--operators``: the grid to time (`profile.operators`: the quick one or the full), the device and the
    precision resolved for it, and a writable ``out``. ``others``: flag -> whether it was given, for the flags that
    do not apply."""
    given = [flag for flag, on in others.items() if on]
    if given:
        raise UserError("applies to a profile, not to timing an operator table (--operators)", where=given[0])
    check_output_file(out, kind="operator table", schema=OPERATORS_SCHEMA, force=force, example="operators.json")
    from terapipe_cli.profile.operators import CPU_GRID, GPU_GRID, QUICK_GRID  # PyTorch: only when timing

    dev = _probe().resolve_device(device)
    grid = QUICK_GRID if quick else GPU_GRID if dev.type == "cuda" else CPU_GRID
    return grid, dev, resolve_precision(precision, dev.type)


def measurement_request(
    cfg: ModelConfig,
    *,
    batch_sizes: Sequence[int],
    token_step: int,
    device: str,
    quick: bool,
    check: bool,
    seed: int,
    clock: str | None,
    hardware: Path | None,
    tensor_parallel: int,
    precision: str | None = None,
) -> tuple[Settings, torch.device]:
    """For measuring this machine: what to time (`Settings`, with the precision resolved for the device: None
    or auto is bf16 on CUDA, fp32 on CPU) and on which device, refused at once if the largest tile would not
    fit in its memory. ``--hardware`` belongs to --analytic; ``tensor_parallel`` > 1 is checked by
    `check_tensor_parallel` and times with wall time on a CPU."""

    if hardware is not None:
        raise UserError("only applies with --analytic", where="--hardware")
    dev = _probe().resolve_device(device)
    check_tensor_parallel(cfg, tensor_parallel, dev.type, clock)
    prec = resolve_precision(precision, dev.type)
    sizes = batch_sizes or parse_batch_sizes(DEFAULT_BATCH_SIZES)
    default_clock = "wall" if tensor_parallel > 1 else "cpu"
    settings = Settings.make(
        cfg, sizes, token_step, quick=quick, check=check, seed=seed, clock=clock or default_clock, precision=prec
    )
    _probe().check_fits_in_memory(cfg, max(settings.batch_sizes), dev)
    return settings, dev


def check_tensor_parallel(cfg: ModelConfig, tensor_parallel: int, device: str, clock: str | None) -> None:
    """T processes time the layer as the T tensor ranks of a stage (`profile.tensor_parallel`): T must split the
    model's heads, and each process needs its own GPU (CUDA) or core (CPU). On a CPU they are timed with wall
    time: process CPU time would not count the waits inside the tensor-parallel all-reduces."""

    cfg.check_tensor_parallel(tensor_parallel, where="--tensor-parallel")
    if tensor_parallel == 1:
        return
    if device == "cuda":
        gpus = _probe().gpu_count()
        if gpus < tensor_parallel:
            raise UserError(
                f"{tensor_parallel} processes need one GPU each, and this machine has {gpus}; estimate it with "
                "`terapipe profile --analytic`",
                where="--tensor-parallel",
            )
        return
    cores = os.cpu_count() or 1
    if tensor_parallel > cores:
        raise UserError(
            f"{tensor_parallel} processes need a core each to be timed, and this machine has {cores}",
            where="--tensor-parallel",
        )
    if clock == "cpu":
        raise UserError(
            "cpu cannot see the waits inside the tensor-parallel all-reduces; --tensor-parallel is timed with "
            "wall time (leave --clock out)",
            where="--clock",
        )


def calibration_request(
    measured: Sequence[Path],
    *,
    hardware: Path | None,
    precision: str | None,
    out: Path | None,
    force: bool,
    others: dict[str, bool],
) -> tuple[Measurement, int, Hardware, str, Path]:
    """For ``--calibrate``: the measured tile times (measured profiles and CSV tile tables, whose precision
    ``--precision`` names; several are fitted together, `calibrate.combine`), how many tiles that left out, the
    hardware file to fit, its text, and a writable ``out`` (default ``NAME-calibrated.toml`` here). ``others``:
    flag -> whether it was given, for the flags that do not apply. The measurement's device and precision must
    be the hardware file's."""

    given = [flag for flag, on in others.items() if on]
    if given:
        raise UserError("applies to measuring or estimating a profile, not to --calibrate", where=given[0])
    if hardware is None:
        raise UserError(
            "is required with --calibrate (the hardware TOML to fit, e.g. configs/hardware/h100-fp32.toml)",
            where="--hardware",
        )
    hw = load_hardware(hardware)
    text = read_user_text(Path(hw.path), name="hardware file", expected="a hardware TOML file")
    asked = None if precision in (None, "auto") else precision
    measurements = []
    for path in measured:
        if path.suffix.lower() == ".csv":
            if asked is None:
                raise UserError(
                    f"a tile table does not record its precision; name it with --precision ({hw.path} prices "
                    f"{hw.training.dtype})",
                    where=str(path),
                )
            measurements.append(read_tile_table(path, asked))
        else:
            measurements.append(from_profile(read_profile(path)))
            if asked is not None and asked != measurements[-1].precision:
                raise UserError(
                    f"{asked} asked for, but {path} was measured in {measurements[-1].precision}; leave --precision "
                    "out",
                    where="--precision",
                )
    measurement, left_out = combine(measurements)
    check_matches(measurement, hw)
    out = out if out is not None else Path(f"{Path(hw.path).stem}-calibrated.toml")
    if out.exists() and out.resolve() == Path(hw.path).resolve():
        raise UserError(f"is the --hardware file {hw.path} itself; write the calibrated file elsewhere", where="--out")
    check_output_file(out, kind="hardware file", schema=None, force=force, example="h100-calibrated.toml")
    return measurement, left_out, hw, text, out
