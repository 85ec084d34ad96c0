"""``terapipe profile``: measure (or, with --analytic, estimate) the cost model and write the profile JSON."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from terapipe_cli.cli.console import ProgressBar, make_console
from terapipe_cli.cli.options import config_option, given, option, with_settings
from terapipe_cli.config.device import device_setting, precision_setting
from terapipe_cli.config.fields import Fallbacks, read_table, setting
from terapipe_cli.files import write_json_atomic, write_text_atomic
from terapipe_cli.plan.costmodel import profile_from_dict
from terapipe_cli.plan.fit_quality import fit_warnings
from terapipe_cli.profile import options
from terapipe_cli.profile.analytic import kernels_per_tile
from terapipe_cli.profile.calibrate import calibrate, calibrated_toml
from terapipe_cli.units import format_link, format_seconds

HELP = """Measure the cost model t(b, i, j) of docs/design.md §3 on this machine and write a profile JSON for `terapipe plan`.

Times one decoder layer through the runtime's own per-slice code path (forward and backward on a grid of token lengths and batch sizes), fits the context term on random tiles and reports its error on held-out ones, measures the stage-to-stage link between two torchrun processes, the gradient all-reduce that data-parallel replicas run (torchrun with one process per GPU, or two CPU processes; `terapipe plan --data-parallel` prices it) and the optimizer step. One thread on CPU (a stage owns one core); CUDA when a GPU is present (--device auto). --precision picks the compute precision timed and recorded in the profile (default bf16 on CUDA, fp32 on CPU); `terapipe plan` carries it into the plan and `terapipe train` runs it.

--tensor-parallel T times the layer as one of a stage's T tensor ranks (heads and MLP split, all-reduces inside every tile): T torchrun processes, one GPU each on CUDA (NCCL) or one core each on CPU (gloo, wall time); the profile records T, and `terapipe plan` plans at it.

--check also times tiles off the measured grids and compares them with the profile's prediction; --check-profile does that for an existing profile, at its precision: a measured one on the kind of device it was measured on, an analytic one only on the device and in the precision it describes (the same GPU model, e.g. the hardware file's "NVIDIA H100-SXM5-80GB" and CUDA's "NVIDIA H100 80GB HBM3"; elsewhere it is refused: measure a profile instead). --analytic estimates a profile for hardware you do not have.

--operators times this device's operators (matrix products, attention, element-wise passes, a kernel's host cost) into an operator table; --analytic --operator-table then prices any model's profile kernel by kernel from that table instead of a hardware file's roofline.

--calibrate fits a hardware file's dispatch floor and matrix-product efficiency to a measured profile of the same device and precision (or to a CSV tile table, with --precision), writes the calibrated hardware TOML and prints the fit's error per tile size; --analytic with that file then predicts what the runtime measures. Given more than once, the files are fitted together; a tile table's eager rows (a stand-alone layer) then give way to the profile's (the runtime's own code path), and its CUDA-graphed rows pin the GPU's own constants.

Examples:

    terapipe profile --model configs/models/tiny.toml --out profile.json

    terapipe profile --model configs/models/tiny.toml --quick --check

    terapipe profile --model tiny --quick --tensor-parallel 2 --out profile-t2.json

    terapipe profile --check-profile profile.json

    terapipe profile --analytic --hardware configs/hardware/v100.toml --model configs/models/gpt3-175b.toml -t 8

    terapipe profile --calibrate profile.json --hardware h100-fp32 --out h100-fp32-calibrated.toml

    terapipe profile --operators --out ops.json   # time this device's operators (--quick: a smaller grid)

    terapipe profile --analytic --operator-table ops.json --model llama-tiny --out llama-tiny.json

    terapipe profile --calibrate profile.json --calibrate tiles.csv --precision bf16 --hardware h100-bf16

    terapipe profile --config profile.toml --quick   # the settings of its [profile] table (keys: the options' names)
"""  # noqa: E501


TABLE = "profile"  # a --config file's table of these settings


@dataclass(frozen=True)
class ProfileOptions(Fallbacks):
    """`terapipe profile`'s settings, each declared once: its flag (`cli.options.settings_options`), its key in a
    ``--config`` file's ``[profile]`` table (paths relative to the file) and its help; what neither the flags nor the
    file give takes the field's ``fallback`` (`value`)."""

    model: str | None = setting(
        "The model: a TOML file, a bundled name (`terapipe configs`), or a transformers folder (Llama, Mistral, GPT-2: "
        "its config.json is read).",
        short="-m",
    )
    batch_sizes: str | None = setting(
        "Batch-slice sizes to measure, comma-separated.", fallback=None, shown=options.DEFAULT_BATCH_SIZES
    )
    token_step: int | None = setting("Token slices are multiples of this (the profile's grid).", short="-g", fallback=8)
    device: str | None = device_setting()
    precision: str | None = precision_setting("auto: bf16 on CUDA, fp32 on CPU")
    quick: bool | None = setting(
        "Coarse grid, few repeats: about 30 s for the tiny model (10 min at L = 16384).", fallback=False
    )
    check: bool | None = setting(
        "Also time tiles off the grids and compare with the profile's prediction.", fallback=False
    )
    check_profile: str | None = setting(
        "Check an existing profile (measured, or analytic for this device and precision) against direct timings now; "
        "writes nothing.",
        path=True,
    )
    comm: bool | None = setting(
        "Measure the stage-to-stage link through torchrun (--no-comm: skip it; the profile records a free link).",
        fallback=True,
    )
    allreduce: bool | None = setting(
        "Measure the data-parallel all-reduce through torchrun (--no-allreduce: skip it; the profile has no "
        "data_parallel_link, and plans with --data-parallel leave the all-reduce out).",
        fallback=True,
    )
    clock: str | None = setting(
        "CPU only: cpu (process CPU time: a stage owns its core, other processes' time is not its cost) or wall.",
        choices=("cpu", "wall"),
        shown="cpu; with --check-profile, the profile's clock",
    )
    seed: int | None = setting("Seed of the weights and of the random tile choice.", fallback=0)
    analytic: bool | None = setting(
        "Estimate from a hardware file instead of measuring (needs --hardware).", fallback=False
    )
    hardware: str | None = setting("Hardware TOML for --analytic or --calibrate (configs/hardware/NAME.toml).")
    calibrate: list[str] | None = setting(
        "Fit --hardware's dispatch floor and matrix-product efficiency to this measured profile (or CSV tile table, "
        "with --precision) of the same device and precision; writes the calibrated hardware TOML. Repeat to fit "
        "several files together.",
        path=True,
        metavar="FILE",
    )
    tensor_parallel: int | None = setting(
        "Processes per stage T, splitting heads and the MLP: timed by T torchrun processes here, or estimated with "
        "--analytic (GPUs per tensor-parallel group).",
        short="-t",
        fallback=1,
    )
    out: str | None = setting(
        "Where to write the profile JSON (with --calibrate: the hardware TOML).",
        short="-o",
        path=True,
        shown="profile.json; with --calibrate, HARDWARE-calibrated.toml",
    )
    operators: bool | None = setting(
        "Time this device's operators (matrix products, attention, element-wise passes, a kernel's host cost) at "
        "--precision into an operator table at --out (default operators.json); --quick: a smaller grid.",
        fallback=False,
    )
    operator_table: str | None = setting(
        "With --analytic: price every kernel from this operator table (made by --operators) instead of a hardware "
        "file's roofline; --hardware, if given, then prices only the links, the optimizer and the memory.",
        path=True,
        metavar="OPS.json",
    )
    force: bool | None = setting("Overwrite --out even if it is not a profile (--calibrate: any file).", fallback=False)
    memory_trace: bool | None = setting(
        "Also trace a stage's memory through the runtime's code on fake tensors (what a tile keeps and the peaks of "
        "its actions, per stage kind; a CUDA profile with the caching allocator's blocks) and store it for `terapipe "
        "plan`'s memory estimate (a minute or two on a CPU, whatever the model's size).",
        fallback=False,
    )


def profile(*, config: Path | None, **settings) -> None:
    """``terapipe profile``: the settings from ``--config`` with the flags given over them (`ProfileOptions`)."""
    from_file = ProfileOptions(**read_table(ProfileOptions, config, TABLE, what="profile setting")) if config else None
    flags = given(settings)
    _profile(replace(from_file or ProfileOptions(), **flags))


def _profile(o: ProfileOptions) -> None:
    console = make_console()
    model = None if o.model is None else Path(o.model)
    hardware = None if o.hardware is None else Path(o.hardware)
    out = None if o.out is None else Path(o.out)
    if o.calibrate:
        others = {
            "--model": model is not None, "--analytic": o.value("analytic"), "--check": o.value("check"),
            "--quick": o.value("quick"), "--check-profile": o.check_profile is not None,
            "--batch-sizes": o.batch_sizes is not None, "--tensor-parallel": o.value("tensor_parallel") != 1,
            "--no-comm": not o.value("comm"), "--no-allreduce": not o.value("allreduce"),
        }  # fmt: skip
        calibrated = [Path(c) for c in o.calibrate]
        _calibrate(console, calibrated, hardware=hardware, precision=o.precision, out=out, force=o.value("force"),
                   others=others)  # fmt: skip
        return
    if o.value("operators"):
        _measure_operators(console, o, out if out is not None else Path("operators.json"))
        return
    out = out if out is not None else Path("profile.json")
    quick, seed, analytic = o.value("quick"), o.value("seed"), o.value("analytic")
    if o.check_profile is not None:
        _recheck(console, Path(o.check_profile), o.value("device"), o.precision, quick, seed, o.clock, model=model,
                 analytic=analytic)  # fmt: skip
        return
    cfg, sizes = options.model_to_profile(model, o.batch_sizes, out, o.value("force"))
    T, g = o.value("tensor_parallel"), o.value("token_step")
    if analytic:
        prof = options.analytic_request(
            cfg, hardware=hardware, tensor_parallel=T, batch_sizes=sizes, token_step=g, check=o.value("check"),
            quick=quick, no_comm=not o.value("comm"), no_allreduce=not o.value("allreduce"), precision=o.precision,
            operator_table=None if o.operator_table is None else Path(o.operator_table),
        )  # fmt: skip
        prof["model_source"] = options.model_source(model)  # for the advice to profile it again
        if o.value("memory_trace"):
            _trace_memory(console, prof, cfg)
        _write(console, out, prof)
        return
    settings, dev = options.measurement_request(
        cfg, batch_sizes=sizes, token_step=g, device=o.value("device"), quick=quick, check=o.value("check"),
        seed=seed, clock=o.clock, hardware=hardware, tensor_parallel=T, precision=o.precision,
    )  # fmt: skip
    measure = {"measure_comm": o.value("comm"), "measure_allreduce": o.value("allreduce"), "tensor_parallel": T}
    source = options.model_source(model)
    _measure(console, cfg, settings, dev, measure, out=out, memory_trace=o.value("memory_trace"), model_source=source)


def _measure_operators(console: Console, o: ProfileOptions, out: Path) -> None:
    """``--operators``: time this device's operator table (`profile.operators`) and write it to ``out``."""
    grid, dev, precision = options.operators_request(o.value("device"), o.precision, o.value("quick"), out, others={
        "--model": o.model is not None, "--analytic": o.value("analytic"), "--check": o.value("check"),
        "--hardware": o.hardware is not None, "--operator-table": o.operator_table is not None,
        "--tensor-parallel": o.value("tensor_parallel") != 1, "--memory-trace": o.value("memory_trace"),
    }, force=o.value("force"))  # fmt: skip
    from terapipe_cli.profile.operators import measure_operators  # PyTorch: loaded by the commands that time

    quick = ", quick" if o.value("quick") else ""
    console.print(f"Timing operators on {dev.type} in {precision}: {grid.describe()}{quick}")
    started = time.perf_counter()
    with ProgressBar(console) as update:
        table = measure_operators(dev, precision, grid, seed=o.value("seed"), progress=update)
    write_json_atomic(out, table)
    tiles = "; ".join(
        f"{arch} {_ms(terms['forward'])} forward, {_ms(terms['backward'])} backward"
        for arch, terms in table["tile_host_s"].items()
    )
    console.print(
        f"host cost of a kernel {_ms(table['host_s'])}; host's work per tile beyond its kernels: {tiles}; "
        f"took {time.perf_counter() - started:.1f} s\nwrote [bold]{out}[/bold]"
    )


def _trace_memory(console: Console, prof: dict, cfg) -> None:
    """Add the memory traced on fake tensors (`profile.memtrace`) to ``prof``, for its precision, T and device."""
    from terapipe_cli.plan.memory import device_loss_chunk_tokens
    from terapipe_cli.profile.memtrace import trace_memory  # PyTorch: only when asked

    started = time.perf_counter()
    tensor_parallel = int(prof["device"].get("tensor_parallel", 1))
    cuda = prof["device"].get("kind") == "cuda"
    # The head's chunk a plan of this profile records and the runtime then takes (`planned_loss_chunk_tokens`, from the
    # same fields): the trace runs with it.
    vocab_parallel = bool(prof.get("vocab_parallel", False))
    chunk = device_loss_chunk_tokens(cfg, tensor_parallel, vocab_parallel, prof["device"].get("memory_bytes"))
    with console.status("tracing a stage's memory on fake tensors"):
        prof["memory"] = trace_memory(
            cfg,
            precision=prof.get("precision", "fp32"),
            tensor_parallel=tensor_parallel,
            cuda=cuda,
            token_step=int(prof["token_step"]),
            loss_chunk_tokens=chunk,
        )
    err = prof["memory"]["heldout_rel_err_max"]
    console.print(
        f"memory traced in {time.perf_counter() - started:.0f} s: the fit within {100 * err:.1f}% on held-out tiles"
    )


def _measure(
    console: Console, cfg, settings, dev, measure: dict, *, out: Path, memory_trace: bool = False, model_source=None
) -> None:
    """``measure``: the keyword arguments of `measure_profile` that say what to measure; ``model_source``: how
    ``--model`` named the model (`options.model_source`), recorded for the advice to profile it again."""
    from terapipe_cli.profile.measure import measure_profile  # PyTorch: loaded by the commands that time

    T = measure["tensor_parallel"]
    console.print(
        f"Profiling one decoder layer of [bold]{cfg.name}[/bold] (H={cfg.hidden}, heads={cfg.heads}, L={cfg.seq_len}) "
        f"on {dev.type}" + (f" as one of {T} tensor ranks" if T > 1 else "") + f" in {settings.precision}: "
        f"batch sizes {list(settings.batch_sizes)}, "
        f"{len(settings.token_lengths)} token lengths "
        f"(step {settings.token_step}), {settings.fit_points}+{settings.heldout_points} context tiles"
        + (f", {settings.check_points} check tiles" if settings.check_points else "")
        + f", {settings.repeats} rounds"
        + (", quick" if settings.quick else "")
    )
    started = time.perf_counter()
    with ProgressBar(console) as update:
        prof = measure_profile(cfg, settings, dev, progress=update, **measure)
    if model_source is not None:
        prof["model_source"] = model_source
    if memory_trace:
        _trace_memory(console, prof, cfg)
    _write(console, out, prof, seconds=time.perf_counter() - started)


def _write(console: Console, out: Path, prof: dict, *, seconds: float | None = None) -> None:
    write_json_atomic(out, prof)
    if prof["source"] in ("analytic", "operators"):
        _render_analytic(console, prof)
    else:
        _render(console, prof, seconds)
    for warning in fit_warnings(profile_from_dict(prof, str(out))):
        make_console(stderr=True).print(f"[yellow]warning:[/yellow] {warning}", soft_wrap=True, highlight=False)
    console.print(f"wrote [bold]{out}[/bold]")


def _ms(s: float) -> str:
    return format_seconds(s, digits=3)


def _render(console: Console, prof: dict, seconds: float) -> None:
    dev = prof["device"]
    title = f"profile of {prof['model']['name']} on {dev['kind']} ({dev['name']}) in {prof['precision']}"
    tensor_parallel = dev.get("tensor_parallel", 1)
    title += f", one of {tensor_parallel} tensor ranks" if tensor_parallel > 1 else ""
    t = Table(title=title, show_header=False)
    t.add_column(style="bold")
    t.add_column()
    fwd, bwd = prof["forward_s"], prof["backward_s"]
    t.add_row(
        "no-context tile, smallest",
        f"b={prof['batch_sizes'][0]}, i={prof['token_lengths'][0]}: "
        f"{_ms(fwd[0][0])} forward + {_ms(bwd[0][0])} backward",
    )
    t.add_row(
        "no-context tile, largest",
        f"b={prof['batch_sizes'][-1]}, i={prof['token_lengths'][-1]}: "
        f"{_ms(fwd[-1][-1])} forward + {_ms(bwd[-1][-1])} backward",
    )
    for which in ("forward", "backward"):
        c = prof["context"][which]
        t.add_row(
            f"context fit, {which}",
            f"held-out tile error mean {c['heldout_rel_err_mean']:.1%}, max {c['heldout_rel_err_max']:.1%} "
            f"({c['heldout_points']} tiles); context term alone: mean {c['heldout_context_only_rel_err_mean']:.0%}",
        )
    comm = prof["comm"]
    t.add_row("link", f"{format_link(comm['latency_s'], comm['bytes_per_s'])} ({comm['method']})")
    t.add_row("data-parallel all-reduce", _allreduce_text(prof))
    t.add_row("optimizer step", f"{_ms(prof['optimizer_s_per_layer'])} per layer (AdamW)")
    t.add_row("activations", f"{prof['activation_bytes_per_token_per_layer'] / 1024:.1f} KiB per token per layer")
    t.add_row("took", f"{seconds:.1f} s")
    console.print(t)
    if "check" in prof:
        _render_check(console, prof["check"])


def _allreduce_text(prof: dict) -> str:
    link = prof.get("data_parallel_link")
    if link is None:
        return prof.get("data_parallel_link_skipped", "not measured")
    whole = link["allreduce_fit"]
    return (
        f"{format_link(whole['latency_s'], whole['bytes_per_s'])} over {link['replicas']} processes; ring step "
        f"{format_link(link['latency_s'], link['bytes_per_s'])} (fit error mean {link['fit_rel_err_mean']:.1%})"
    )


def _render_check(console: Console, check: dict, *, estimated: bool = False) -> None:
    """``estimated``: the profile is an analytic estimate, so the reference tiles' ratio is how far off its overall
    speed is, not a drift of this machine since it was measured."""
    t = Table(title="check: tiles off the grids, the profile's cost(b, i, j) vs a direct timing (one layer)")
    for col in ("b", "i", "j", "measured", "predicted", "error"):
        t.add_column(col, justify="right")
    for r in check["points"]:
        t.add_row(
            str(r["b"]), str(r["i"]), str(r["j"]), _ms(r["measured_s"]), _ms(r["predicted_s"]), f"{r['rel_err']:.1%}"
        )
    console.print(t)
    console.print(f"check: relative error mean {check['rel_err_mean']:.1%}, max {check['rel_err_max']:.1%}")
    if "reference" in check:
        ratio = check["reference"]["speed_ratio"]
        if estimated:
            speed = f"this device's speed: tiles on the estimate's own grid take {ratio:.3f}× their estimated time"
            scale = "that scale"
        else:
            speed = f"machine speed now: tiles on the profile's own grid take {ratio:.3f}× their profiled time"
            scale = "that drift"
        console.print(
            f"{speed}; with {scale} divided out the check's error is mean {check['drift_adjusted_rel_err_mean']:.1%}, "
            f"max {check['drift_adjusted_rel_err_max']:.1%}"
        )


def _recheck(
    console: Console,
    path: Path,
    device: str,
    precision: str | None,
    quick: bool,
    seed: int,
    clock: str | None,
    *,
    model,
    analytic: bool,
) -> None:
    from terapipe_cli.profile import measure, probe  # PyTorch: loaded by the commands that time

    prof, dev = options.profile_to_check(path, device, precision=precision, model=model, analytic=analytic)
    estimated = prof.source != "measured"
    what = f"an {prof.source} estimate for " if estimated else ""
    console.print(
        f"Checking [bold]{path}[/bold] ({what}{prof.device.get('name')}) "
        f"against direct timings on {dev.type} ({probe.device_info(dev)['name']}) in {prof.precision}"
    )
    with ProgressBar(console) as update:
        result = measure.recheck_profile(
            prof.raw, dev, count=4 if quick else 8, repeats=3 if quick else 5, seed=seed, clock=clock, progress=update
        )
    _render_check(console, result, estimated=estimated)


def _render_analytic(console: Console, prof: dict) -> None:
    ctx = prof["context"]
    console.print(
        f"{prof['source']} profile of {prof['model']['name']} on {prof['device']['name']} "
        f"(tensor parallel {prof['device']['tensor_parallel']}, {prof['precision']}): "
        f"context fit held-out error forward {ctx['forward']['heldout_rel_err_mean']:.2%} mean, "
        f"backward {ctx['backward']['heldout_rel_err_mean']:.2%} mean"
    )


def _calibrate(console: Console, measured: list[Path], *, hardware, precision, out, force: bool, others: dict) -> None:
    """``--calibrate``: fit, write the calibrated hardware TOML, show the error per tile size."""
    measurement, left_out, hw, text, out = options.calibration_request(
        measured, hardware=hardware, precision=precision, out=out, force=force, others=others
    )
    result = calibrate(measurement, hw)
    write_text_atomic(out, calibrated_toml(text, result, measurement.source))
    _render_calibration(console, result, measurement.source)
    if left_out:
        console.print(
            f"left out: the tile tables' {left_out} eager tiles (a stand-alone layer; the profile times the runtime's "
            "own code path, host dispatch included); their CUDA-graphed tiles are fitted"
        )
    console.print(f"wrote [bold]{out}[/bold]")


def _render_calibration(console: Console, result, measured: str) -> None:
    before, after = result.uncalibrated.device, result.hardware.device
    t = Table(
        title=f"calibration of {result.uncalibrated.path} on {measured}: tile time (forward + backward of one layer), "
        "mean per tile size",
    )
    for col in ("tiles", "b·i", "count", "measured", "calibrated", "error", "max", "uncalibrated", "error"):
        t.add_column(col, justify="left" if col == "tiles" else "right")
    for r in result.rows:
        t.add_row(
            r.kind, f"{r.low + 1}-{r.high}", str(r.tiles), _ms(r.measured_s), _ms(r.calibrated_s),
            f"{r.rel_err_mean:.1%}", f"{r.rel_err_max:.1%}",
            _ms(r.uncalibrated_s), f"{r.uncalibrated_rel_err_mean:.0%}",
        )  # fmt: skip
    t.add_section()
    t.add_row(
        "all", "", str(result.tiles), "", "", f"{result.rel_err_mean:.1%}", f"{result.rel_err_max:.1%}", "",
        f"{result.uncalibrated_rel_err_mean:.0%}",
    )  # fmt: skip
    console.print(t)
    fitted = ", ".join(f"{k} {getattr(before, k):.4g} -> {v:.4g}" for k, v in result.fitted.items())
    console.print(f"fitted: {fitted}")
    if result.at_bounds:
        edges = ", ".join(result.at_bounds)
        console.print(f"at the edge of the range searched (not pinned down by these tiles): {edges}")
    if after.dispatch_s:
        fwd, bwd = kernels_per_tile(result.hardware.training.dtype)
        console.print(
            f"dispatch floor: {fwd} kernels forward, {bwd} backward × {after.dispatch_s * 1e6:.1f} µs = "
            f"{_ms(fwd * after.dispatch_s)} + {_ms(bwd * after.dispatch_s)} per tile and layer"
        )


def register(app: typer.Typer) -> None:
    command = with_settings(profile, ProfileOptions, option("config", config_option(TABLE), None))
    app.command("profile", help=HELP)(command)
