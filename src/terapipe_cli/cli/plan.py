"""``terapipe plan``: run the planner on a profile and write the plan JSON."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import typer
from rich.table import Table

from terapipe_cli.cli.console import PlainProgress, make_console, plain_progress
from terapipe_cli.cli.options import config_option, given, option, with_settings
from terapipe_cli.config.device import available_memory_bytes
from terapipe_cli.config.experiment import load_experiment
from terapipe_cli.config.fields import Fallbacks, read_table, setting
from terapipe_cli.engine import require_torch
from terapipe_cli.engine.hostmem import retain_freed_memory
from terapipe_cli.errors import UserError
from terapipe_cli.files import check_output_file, write_text_atomic
from terapipe_cli.plan.choice import SCHEMES, Planned
from terapipe_cli.plan.configs import plan_configured
from terapipe_cli.plan.costmodel import Profile, profile_from_dict, read_profile
from terapipe_cli.plan.documents import AttendedContext
from terapipe_cli.plan.domain import domain_of, provenance
from terapipe_cli.plan.file import PLAN_SCHEMA, write_plan
from terapipe_cli.plan.fit_quality import fit_warnings
from terapipe_cli.plan.request import (
    PARTITIONS,
    PlanSetting,
    check_work,
    experiment_setting,
    experiment_shape,
    stored_path,
)
from terapipe_cli.plan.search import METHODS
from terapipe_cli.profile.analytic import experiment_profile, extended_for_batch
from terapipe_cli.report.preview import write_plan_picture
from terapipe_cli.schedule.orders import ALL_ORDERS, ORDERS, SPLIT_INTERLEAVED, SPLIT_ORDERS, order_of
from terapipe_cli.schedule.partition import parse_layers
from terapipe_cli.units import format_bytes, format_seconds

HELP = """Choose token and batch slicing for a profile with the exact dynamic program (docs/design.md §5).

Prints the TeraPipe scheme next to the GPipe baseline and the best uniform slicing, all priced by the same
cost model, and writes the plan JSON that `terapipe train` runs. The plan records the profile's precision
(fp32, bf16 or fp16) and tensor-parallel degree T: its times hold only for those, so `terapipe train` runs them,
with D × K × T workers.

--experiment plans a published setting (configs/experiments/, by path, bundled name or the start of one) in one
command: its model, stages, data-parallel and tensor-parallel degrees, batch and token step, priced by the
analytic profile of its hardware at its T (--analytic of `terapipe profile`) unless --profile is given. Options
given explicitly (-k, -b, -d, -t, -g) override the file's values; --batch is per replica, and without it the
file's global batch is divided by the data-parallel degree.

Examples:

    terapipe plan --profile configs/profiles/example-tiny-cpu.json --stages 2 --batch 1 --out plan.json

    terapipe plan --experiment paper-08-gpt3-44b --out plan-44b.json

    terapipe plan --experiment paper-04 --data-parallel 4 --out plan-13b-d4.json

    terapipe plan --profile p.json -k 4 -b 2 --show-schedule --schedule-out my-order.csv

    terapipe plan --config plan.toml -b 4   # the settings of its [plan] table, the batch overridden

    terapipe plan --profile configs/profiles/tiny-cpu-measured.json -k 2 -b 4 --tune 2   # train the best 2 here
"""


TABLE = "plan"  # a --config file's table of these settings


@dataclass(frozen=True)
class PlanOptions(Fallbacks):
    """`terapipe plan`'s settings, each declared once: its flag (`cli.options.settings_options`), its key in a
    ``--config`` file's ``[plan]`` table (`read_fields`: type, choices, paths relative to the file) and its help.
    Every field defaults to None (not given): flags given override the file, and what neither gives takes the
    field's ``fallback`` (`value`), or a default of the setting's own (the experiment's, the profile's)."""

    profile: str | None = setting(
        "Profile JSON (terapipe.profile/1-3) from `terapipe profile` (required without --experiment).", path=True
    )
    stages: int | None = setting("Pipeline stages K, at most the model's layers.", short="-k", shown="the experiment's")
    batch: int | None = setting(
        "Sequences per pipeline replica per step (B).", short="-b", shown="the experiment's B / D"
    )
    experiment: str | None = setting(
        "Plan this experiment file's setting (a path, a bundled name such as paper-09-gpt3-175b, or the start of "
        "exactly one); options given explicitly override its values.",
        short="-e",
    )
    seq_len: int | None = setting("Sequence length L.", shown="the model's")
    token_step: int | None = setting(
        "Token slices are multiples of this.", short="-g", shown="the experiment's, else the profile's"
    )
    epsilon: float | None = setting(
        "Seconds; > 0 allows an answer within stages × epsilon of the optimum.", fallback=0.0
    )
    method: str | None = setting(
        "exact, or enumerate (the published ε-enumeration, slower).", choices=METHODS, fallback="exact"
    )
    data_parallel: int | None = setting(
        "Pipeline replicas D; adds their gradient all-reduce per step (left out, with a warning, when the profile "
        "has no data_parallel_link).",
        short="-d",
        shown="the experiment's, else 1",
    )
    tensor_parallel: int | None = setting(
        "Processes per stage T, splitting heads and the MLP; must be the T the profile was made at.",
        short="-t",
        shown="the profile's, or the experiment's",
    )
    memory_limit: float | None = setting(
        "GiB per device: the plan is the fastest scheme whose estimated peak fits on every stage (over token "
        "slicing, batch grouping, the order and which stages recompute, where not fixed by --order or --recompute); "
        "when none fits, one line with the smallest possible peak.",
        shown="a GPU profile's device memory (a CPU's memory, shared by all workers, only warns)",
    )
    order: str | None = setting(
        "Schedule order: "
        + ", ".join(f"{o.name} ({o.summary})" for o in map(order_of, ALL_ORDERS))
        + f" or auto (the searches in {' and '.join(ORDERS)} order, then, where the profile timed I and W apart "
        f"(measured, schema /2), the result split into {', '.join(SPLIT_INTERLEAVED)}, and "
        f"{', '.join(o for o in SPLIT_ORDERS if o not in SPLIT_INTERLEAVED)} as a configuration of its own: the "
        "fastest in the simulator whose memory estimate fits; another profile's split is an estimate, planned only "
        "when asked).",
        choices=("auto", *ALL_ORDERS),
        fallback="auto",
    )
    virtual_stages: str | None = setting(
        "Chunks of layers per device, v (Megatron's interleaving: device k runs chunks k, k+K, ...; the bubble "
        "shrinks by v, the stage-to-stage traffic grows v-fold), or auto: the fastest simulated v from 1 to 4.",
        fallback="auto",
    )
    layers_per_stage: str | None = setting(
        "The decoder layers of every stage (of every chunk with v > 1), e.g. 5,6,6,7: K (K·v) counts summing to the "
        "model's layers; the first and last may be 0 (they embed and run the head)."
    )
    partition: str | None = setting(
        "How the layers are cut when --layers-per-stage is not given: auto (the split the objective prices "
        "fastest, the embedding and the LM head counted) or balanced (the most even by layers alone).",
        choices=PARTITIONS,
        shown="auto",
    )
    recompute: bool | None = setting(
        "Every stage keeps only each tile's input and runs its forward again in the backward: priced as one more "
        "forward per tile, in the memory estimate as the activations not kept; --no-recompute: no stage recomputes, "
        "whatever the memory limit.",
        shown="what fits the memory limit",
    )
    rank: str | None = setting(
        "simulated: among the exact optimum of the objective and the schemes the search ranks next to it (within "
        "5%), the fastest in the schedule simulator (never slower there than the optimum); formula: the exact "
        "optimum of the objective. The plan records both.",
        fallback="simulated",
    )
    show_schedule: bool | None = setting(
        "Print the plan's schedule as a stage x time grid: every action one step, as early as its inputs allow "
        "(0F3.2: stage 0 runs the forward of batch slice 3, token slice 2; B: backward).",
        fallback=False,
    )
    schedule_out: str | None = setting(
        "Also write the plan's schedule as CSV, one row of actions per stage: edit it and train it with `terapipe "
        "train --schedule FILE` (checked for legality there).",
        path=True,
    )
    scheme: str | None = setting(
        "The scheme the plan file runs: terapipe (the planner's), gpipe (whole sequences, the best microbatch) or "
        "uniform (the best equal slicing) — a baseline to train and compare, priced alike.",
        choices=SCHEMES,
        fallback="terapipe",
    )
    show: bool | None = setting(
        "Also draw the plan before training: the simulated timeline of one step next to its GPipe baseline's, and "
        "every stage's estimated peak memory against the limit (PNG beside --out).",
        fallback=False,
    )
    data: list[str] | None = setting(
        "A Megatron corpus (PREFIX of .bin + .idx) the run trains on with its documents masked: each tile's "
        "attention is priced by the context it is expected to attend, from the corpus's document lengths, instead "
        "of the whole prefix. A mixture as train takes it: --data 0.7:web --data 0.3:code.",
        shown="the whole prefix (full causal attention)",
        metavar="[W:]CORPUS",
    )
    out: str | None = setting("Where to write the plan JSON.", short="-o", path=True, fallback="plan.json")
    force: bool | None = setting("Overwrite --out even if it is not a plan.", fallback=False)
    quiet: bool | None = setting("No progress line on stderr while the plan is searched.", short="-q", fallback=False)
    tune: int | None = setting(
        "Train the simulator's N best plans and the GPipe scheme a few steps each, in rounds, on this machine (the "
        "profile's device, measured here) and write the measured fastest; the plan records predicted and measured "
        "for each (plan.tune)."
    )


def load_plan_options(path: Path) -> PlanOptions:
    """`PlanOptions` from the ``[plan]`` table of a TOML file; paths in it are relative to the file."""
    return PlanOptions(**read_table(PlanOptions, path, TABLE, what="plan setting"))


def plan(*, config: Path | None, **settings) -> None:
    """``terapipe plan``: the settings from ``--config`` with the flags given over them (`PlanOptions`)."""
    from_file = load_plan_options(config) if config is not None else PlanOptions()
    flags = given(settings)
    _plan(replace(from_file, **flags))


def _plan(o: PlanOptions) -> None:
    # The search allocates and frees price arrays of tens of megabytes over and over; with glibc's defaults each
    # comes back from the kernel as fresh pages: kept for reuse (engine/hostmem.py).
    retain_freed_memory()
    console = make_console()
    if o.layers_per_stage is not None and o.partition is not None:
        raise UserError(
            f"--partition {o.partition} and --layers-per-stage contradict each other: the layers are given; leave "
            "out --partition",
            where="--layers-per-stage",
        )
    scheme, out = o.value("scheme"), Path(o.value("out"))
    if scheme not in SCHEMES:
        raise UserError(f"must be one of {', '.join(SCHEMES)}, got {scheme!r}", where="--scheme")
    check_output_file(out, kind="plan", schema=PLAN_SCHEMA, force=o.value("force"), example="plan.json")
    schedule_out = None if o.schedule_out is None else Path(o.schedule_out)
    picture = out.with_suffix(".png") if o.value("show") else None
    for path, kind, example, flag in (
        (schedule_out, "schedule", "schedule.csv", "--schedule-out"),
        (picture, "picture", "plan.png", "--show"),
    ):
        if path is not None:
            check_output_file(path, kind=kind, schema=None, force=o.value("force"), example=example, flag=flag)
    setting = setting_from_options(
        profile=o.profile, experiment=o.experiment, stages=o.stages, batch_size=o.batch, data_parallel=o.data_parallel,
        tensor_parallel=o.tensor_parallel, token_step=o.token_step,
    )  # fmt: skip
    tuner = None if o.tune is None else _tuner(setting.profile, o.tune, scheme, o.data)  # refused before planning
    request = setting.request(
        seq_len=o.seq_len, epsilon=o.value("epsilon"), method=o.value("method"), memory_limit_gib=o.memory_limit,
        order=o.value("order"), recompute=o.recompute, rank=o.value("rank"), virtual=o.value("virtual_stages"),
        layers_per_stage=None if o.layers_per_stage is None else parse_layers(o.layers_per_stage),
        partition=o.partition or "auto",
    )  # fmt: skip
    if o.data is not None:
        setting = replace(setting, profile=documents_priced(setting.profile, o.data, request.seq_len))
    prof, r = setting.profile, request
    check_work(prof, r, available_memory_bytes())
    head = f"Planning {prof.model.name}: L={r.seq_len}, B={r.batch_size}, K={r.stages}, token step {r.token_step}"
    with _progress_line(head, o.value("quiet")) as progress:
        configured = plan_configured(prof, request, progress)
        planned = replace(configured.planned, scheme=scheme)
    told = _told(o.value("quiet"))
    tuned = None if tuner is None else tuner(configured, lambda p: _plan_object(p, setting), told)
    planned = planned if tuned is None else tuned.chosen.planned
    _write_and_say(console, o, (request, configured, tuned), planned, setting, (out, schedule_out, picture))


def _write_and_say(console, o: PlanOptions, searched, planned: Planned, setting: PlanSetting, paths) -> None:
    """Write the plan file (and the schedule and picture asked for), then print its table and lines."""
    (request, configured, tuned), (out, schedule_out, picture) = searched, paths
    schedule = planned.schedule()
    if picture is not None:
        with console.status("Drawing the plan's simulated timeline and memory …"):
            write_plan_picture(planned, picture)
    plan_obj = _plan_object(planned, setting)
    if tuned is not None:
        plan_obj["tuning"] = tuned.record()
    write_plan(out, plan_obj)
    if schedule_out is not None:
        write_text_atomic(schedule_out, schedule.to_csv())
    console.print(_table(planned))
    if o.value("show_schedule"):
        _print_schedule(console, schedule)
    _print_lines(console, planned, setting, out)
    if request.virtual is None or request.partition_mode == "auto" or configured.runner_up is not None:
        console.print(configured.line(), highlight=False)
    for line in [] if tuned is None else tuned.lines():
        console.print(line, highlight=False)
    written = [p for p in paths if p is not None]
    scheme = o.value("scheme")
    what = "" if scheme == "terapipe" else f" ({_NAMES[scheme]} {planned.chosen.short_form(fold=True)})"
    console.print("wrote " + " and ".join(f"[bold]{p}[/bold]" for p in written) + what, highlight=False)


def _plan_object(planned: Planned, setting: PlanSetting) -> dict:
    """The plan file's object of ``planned``, with how its attention was priced."""
    obj = planned.to_plan_dict(setting.profile_path, setting.experiment)
    attended = planned.profile.attended
    obj["attention"] = {"context": "prefix"} if attended is None else attended.record()
    return obj


def _tuner(profile: Profile, count: int, scheme: str, data: list[str] | None):
    """``--tune``'s trainer (`train.tune.tuner`), checked now; PyTorch is imported only here."""
    require_torch("--tune")
    from terapipe_cli.train.tune import tuner

    return tuner(profile, count, scheme, data=data is not None)


def _told(quiet: bool):
    """Where ``--tune`` tells each run it timed: a line on stderr, or nowhere with --quiet."""
    return None if quiet else lambda text: make_console(stderr=True).print(f"tuning: {text}", highlight=False)


@contextmanager
def _progress_line(head: str, quiet: bool):
    """A line on stderr that moves while the plan is searched — what is searched, what is left, the best so far —
    (rich, on a terminal); where stderr is not one (a pipe, a log), a plain line every few seconds once the search
    has run a few (`PlainProgress`); nothing with --quiet. Yields the callback `plan_configured` tells."""
    if quiet:
        yield None
        return
    console = make_console(stderr=True)
    if not console.is_terminal:
        with plain_progress(PlainProgress(head, sys.stderr)) as plain:
            yield plain.update
        return
    with console.status(head + " …") as status:
        yield lambda text: status.update(f"{head} — {text}")


def _print_lines(console, planned: Planned, setting: PlanSetting, out: Path) -> None:
    """The lines under the table: the solver and where the profile's numbers come from, the workers (and, for a
    profile of GPU nodes, the launch-script that places them), how the scheme was chosen, its memory; warnings on
    stderr."""
    r, prof, best = planned.request, planned.profile, planned.terapipe
    where = setting.profile_path or f"estimated for {setting.experiment['name']}"
    console.print(
        f"solver: {r.method}, ε = {r.epsilon:g} s, {best.candidates} t_max candidates in {best.seconds:.3f} s · "
        f"profile: {where} ({provenance(prof)})",
        highlight=False,
    )
    domain = domain_of(prof).line(r.batch_size)
    if domain is not None:
        console.print(domain, highlight=False)
    D, K, T = r.data_parallel, r.stages, r.tensor_parallel
    line = f"workers: D × K × T = {D} × {K} × {T} = {D * K * T} processes for `terapipe train`"
    per_node = prof.device.get("gpus_per_node")  # an analytic profile's node
    if isinstance(per_node, int) and D * K * T > per_node and (D * K * T) % per_node == 0:
        nodes = D * K * T // per_node
        script = f"terapipe launch-script {out} --nodes {nodes} --gpus-per-node {per_node}"
        line += f"; on {nodes} nodes of {per_node} GPUs: `{script}`"
    console.print(line, highlight=False)
    if prof.attended is not None:
        a = prof.attended
        console.print(
            f"attention: priced by the context each tile attends over {a.documents:,} documents of {a.source} "
            f"(mean {a.mean_tokens:,.0f} tokens; block-causal, --document-mask), not the whole prefix",
            highlight=False,
        )
    warnings = [planned.allreduce_warning(), *fit_warnings(prof)]
    console.print(f"predicted: {planned.utilisation().text()}", highlight=False)
    for line in (planned.rank_line(), planned.disagreement_line(), planned.memory_choice()):
        if line is not None:
            console.print(line)
    memory = planned.scheme_memory.get(planned.scheme)
    if memory is not None:
        console.print(memory.summary())
        warnings.append(memory.warning())
    for warning in filter(None, warnings):
        make_console(stderr=True).print(f"[yellow]warning:[/yellow] {warning}", soft_wrap=True, highlight=False)


SCHEDULE_STEPS_SHOWN = 48  # time steps of the grid printed; the CSV holds every action


def _print_schedule(console, schedule) -> None:
    """The schedule's grid, its first `SCHEDULE_STEPS_SHOWN` steps."""
    chunks = (
        f" of {schedule.virtual} chunks each (an action's first number is its chunk)" if schedule.virtual > 1 else ""
    )
    console.print(
        f"schedule ({schedule.order} order, {len(schedule.tiles)} tiles on {schedule.stages} stages{chunks}; each "
        "action one step, as early as its inputs allow):",
        highlight=False,
    )
    console.print(schedule.grid(width=SCHEDULE_STEPS_SHOWN), markup=False, highlight=False, soft_wrap=True)


_NAMES = {"terapipe": "TeraPipe (DP)", "gpipe": "GPipe", "uniform": "uniform (best)"}


def _table(planned: Planned) -> Table:
    """The three schemes side by side: formula and simulated latency, speed-up, tiles, largest tile; the title
    names the shape and the precision the profile timed (which the plan records and `terapipe train` runs)."""
    r = planned.request
    title = f"{planned.profile.model.name}: L={r.seq_len}, B={r.batch_size}, K={r.stages}"
    title += f", D={r.data_parallel}" if r.data_parallel > 1 else ""
    title += f", T={r.tensor_parallel}" if r.tensor_parallel > 1 else ""
    title += f", {planned.profile.precision}"
    title += f", {planned.choice_text()}" if planned.choice_text() != "GPipe order" else ""
    table = Table(title=title)
    table.add_column("scheme")
    table.add_column("slicing (short form)", overflow="fold", max_width=70)
    columns = ("simulated step", "speed-up vs GPipe", "formula", "(speed-up)", "tiles", "largest tile", "MFU")
    for column in (*columns, "peak memory"):
        table.add_column(column, justify="right")
    for key, res in planned.ranked():  # one judge: the simulated step ranks the rows and gives the speed-up
        table.add_row(
            _NAMES[key] + (" *" if key == planned.scheme and key != "terapipe" else ""),
            res.short_form(fold=True),
            format_seconds(planned.simulated_s[key]),
            f"{planned.speedup_vs_gpipe(key):.2f}×",
            format_seconds(res.predicted_s),
            f"({planned.formula_speedup_vs_gpipe(key):.2f}×)",
            str(res.tiles),
            format_seconds(res.t_max_s),
            planned.utilisation(key).mfu_text(),
            _memory_cell(planned.scheme_memory.get(key)),
        )
    table.caption = "ranked by the simulated step (docs/design.md §11); formula: the objective of §4"
    memory = planned.scheme_memory.get("terapipe")
    if memory is not None and memory.limit_bytes:
        table.caption += (
            f"\npeak memory: the fullest stage's estimate; (!) more than the {format_bytes(memory.limit_bytes)} "
        )
        table.caption += f"{memory.limit_source}" + (" (all workers of the machine together)" if memory.copies else "")
    if planned.scheme != "terapipe":
        table.caption += "\n*: the scheme the plan file runs (--scheme)"
    return table


def _memory_cell(check) -> str:
    """The fullest stage's estimated peak, marked (!) when it (or, on shared memory, all workers) exceeds the limit."""
    if check is None:
        return "—"  # the profile has no sizes to estimate it from
    text = format_bytes(check.peak_bytes)
    return f"[bold red]{text} (!)[/bold red]" if check.exceeded else text


def setting_from_options(
    *,
    profile: str | Path | None,
    experiment: str | None,
    stages: int | None,
    batch_size: int | None,
    data_parallel: int | None,
    tensor_parallel: int | None,
    token_step: int | None,
) -> PlanSetting:
    """`terapipe plan`'s options as a `PlanSetting`. Without ``experiment``, ``profile``, ``stages`` and
    ``batch_size`` are required; with it, every option left out comes from the experiment file (a path, a bundled
    name or the start of one), and the profile, unless given, is the analytic estimate for its hardware at its T."""
    if experiment is None:
        for value, flag, what in (
            (profile, "--profile", "a profile JSON from `terapipe profile`"),
            (stages, "--stages", "the pipeline stages K"),
            (batch_size, "--batch", "the sequences per replica B"),
        ):
            if value is None:
                raise UserError(f"is required ({what}), unless --experiment names a setting", where=flag)
        prof = read_profile(profile)
        D, T, g = 1 if data_parallel is None else data_parallel, tensor_parallel, token_step  # -d 0 is refused
        return _within_reach(PlanSetting(prof, stored_path(profile), stages, batch_size, D, T, g))
    exp = load_experiment(experiment, flag="--experiment")
    shape = experiment_shape(
        exp, stages=stages, batch_size=batch_size, data_parallel=data_parallel, tensor_parallel=tensor_parallel,
        token_step=token_step,
    )  # fmt: skip
    if profile is not None:
        prof = read_profile(profile)
    else:
        obj = experiment_profile(
            exp, batch_size=max(shape.batch_size, 1), tensor_parallel=shape.tensor_parallel, token_step=shape.token_step
        )
        prof = profile_from_dict(obj, f"the analytic profile of {exp.path}")
    return _within_reach(experiment_setting(exp, shape, prof, profile))


def documents_priced(profile: Profile, data: list[str], seq_len: int) -> Profile:
    """``profile`` pricing attention by the context a tile attends over the packed documents of ``data`` (``--data``
    as train takes it: one corpus, or a weighted mixture; `plan.documents`); one line when a corpus records no
    documents, holds none, or the sources are not ids of one tokenizer."""
    from terapipe_cli.config.run import data_sources
    from terapipe_cli.corpus.formats import open_token_file
    from terapipe_cli.corpus.identity import check_together, vocabulary_of

    sources = data_sources(data, where="--data")
    if len(sources) > 1 and any(w is None for w, _ in sources):
        raise UserError(
            f"several sources each need a weight, e.g. --data 0.7:web --data 0.3:code; got {data}", where="--data"
        )
    parts, vocabularies = [], []
    for _, corpus in sources:
        opened = open_token_file(corpus)
        if opened.documents is None:
            raise UserError(
                f"{corpus} records no documents ({opened.format_name}); a Megatron corpus (`terapipe data tokenize`) "
                "does",
                where="--data",
            )
        lengths = opened.documents.lengths()
        if not lengths.size or lengths.max() <= 0:
            raise UserError(
                f"{corpus} holds no tokens ({len(lengths):,} documents): nothing to train on", where="--data"
            )
        parts.append(AttendedContext.of_lengths(lengths, seq_len, source=corpus))
        vocabularies.append(vocabulary_of(opened.path, opened.format))
    check_together(vocabularies, where="--data")
    if len(parts) == 1:
        return replace(profile, attended=parts[0])
    source = ", ".join(f"{w:g}:{p}" for w, p in sources)
    return replace(profile, attended=AttendedContext.mixed(parts, [w for w, _ in sources], source=source))


def _within_reach(setting: PlanSetting) -> PlanSetting:
    """The setting with an analytic profile priced again at the batch slices its batch needs beyond the profile's
    grid (`profile.analytic.extended_for_batch`); the planner prices no other profile beyond its grid."""
    extended = extended_for_batch(setting.profile, setting.batch_size)
    return setting if extended is None else replace(setting, profile=extended)


def register(app: typer.Typer) -> None:
    app.command("plan", help=HELP)(with_settings(plan, PlanOptions, option("config", config_option(TABLE), None)))
