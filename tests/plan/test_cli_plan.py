"""`terapipe plan` run as a user runs it: its exit code, stdout/stderr and the file it writes (in a real process once,
then through the same entry point in this one)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

import pytest
from conftest import assert_one_line_error, run_cli, terapipe

from terapipe_cli.plan.costmodel import CostModel
from terapipe_cli.plan.file import read_plan, short_form
from terapipe_cli.plan.search import evaluate, gpipe_baseline, solve, uniform_baseline

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "configs" / "profiles" / "example-tiny-cpu.json"
RAW = json.loads(EXAMPLE.read_text())
MEASURED = ROOT / "configs" / "profiles" / "tiny-cpu-measured.json"

PLAN_KEYS = {
    "schema",
    "model",
    "stages",
    "batch_size",
    "seq_len",
    "token_step",
    "data_parallel",
    "slices",
    "short_form",
    "predicted_s",
    "t_max_s",
    "baselines",
    "solver",
    "profile",
    "precision",
}


# One chunk per stage, the even split (docs/design.md §11): these tests compare with the search of one configuration.
PINNED = ("--virtual-stages", "1", "--partition", "balanced")


def plan_args(*extra: str, profile: Path = EXAMPLE, stages: int = 2, batch: int = 2) -> list[str]:
    pinned = () if any(a in extra for a in ("--virtual-stages", "--layers-per-stage", "--partition")) else PINNED
    return ["plan", "--profile", str(profile), "--stages", str(stages), "--batch", str(batch), *pinned, *extra]


# --- a good run ---------------------------------------------------------------------------------------


def test_plan_writes_a_complete_plan(tmp_path: Path) -> None:
    """As a user runs it: a real process. GPipe order, so the plan is the objective's optimum (with the order free the
    simulator may prefer a neighbour of it in another order: tests/plan/test_zero_bubble_choice.py)."""
    out = tmp_path / "plans" / "p.json"
    proc = terapipe(*plan_args("--out", out, "--order", "gpipe"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(out.read_text())
    assert PLAN_KEYS <= set(obj)
    assert obj["schema"] == "terapipe.plan/1"
    # Defaults: L and g from the profile, one replica.
    assert (obj["stages"], obj["batch_size"], obj["data_parallel"]) == (2, 2, 1)
    assert obj["seq_len"] == RAW["model"]["seq_len"] and obj["token_step"] == RAW["token_step"]
    assert obj["model"]["name"] == RAW["model"]["name"]
    assert obj["short_form"] == short_form(obj["slices"])
    assert obj["solver"]["method"] == "exact" and obj["solver"]["epsilon"] == 0
    assert obj["solver"]["seconds"] >= 0 and obj["solver"]["candidates"] >= 1
    assert obj["profile"]["sha256"] == hashlib.sha256(EXAMPLE.read_bytes()).hexdigest()
    assert Path(obj["profile"]["path"]).resolve() == EXAMPLE.resolve()

    # The plan reads back through the one validating reader, and its numbers are the cost model's.
    plan = read_plan(out)
    cost = CostModel.from_profile(EXAMPLE, stages=2)
    assert obj["predicted_s"] == pytest.approx(evaluate(cost, plan.slices, 2), rel=1e-12)
    tiles_max = max(float(cost(b, n, sum(lengths[:k]))) for b, lengths in plan.slices for k, n in enumerate(lengths))
    assert obj["t_max_s"] == pytest.approx(tiles_max, rel=1e-12)
    L, g = obj["seq_len"], obj["token_step"]
    assert obj["predicted_s"] == pytest.approx(solve(cost, seq_len=L, batch_size=2, stages=2, token_step=g).predicted_s)
    for name, ref in (
        ("gpipe", gpipe_baseline(cost, seq_len=L, batch_size=2, stages=2)),
        ("uniform", uniform_baseline(cost, seq_len=L, batch_size=2, stages=2, token_step=g)),
    ):
        base = obj["baselines"][name]
        assert base["predicted_s"] == pytest.approx(ref.predicted_s, rel=1e-12)
        assert base["predicted_s"] == pytest.approx(evaluate(cost, base["slices"], 2), rel=1e-12)
        assert obj["predicted_s"] <= base["predicted_s"]
    assert all(lengths == [L] for _, lengths in obj["baselines"]["gpipe"]["slices"])

    # The table names all three schemes with their short forms.
    assert "GPipe" in proc.stdout and "uniform" in proc.stdout.lower()
    assert obj["short_form"] in proc.stdout
    assert obj["baselines"]["gpipe"]["short_form"] in proc.stdout
    assert sorted(os.listdir(out.parent)) == ["p.json"]  # no temporary file left
    # The example profile predates the precision field: it reads as fp32, and the plan says so.
    assert "precision" not in RAW and obj["precision"] == plan.precision == "fp32"
    assert ", fp32" in proc.stdout


def test_the_plan_copies_the_profiles_precision(tmp_path: Path, capsys) -> None:
    profile = tmp_path / "bf16-profile.json"
    profile.write_text(json.dumps({**RAW, "precision": "bf16"}))
    proc = run_cli(capsys, *plan_args("--out", "plan.json", profile=profile), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert read_plan(tmp_path / "plan.json").precision == "bf16"
    assert json.loads((tmp_path / "plan.json").read_text())["precision"] == "bf16"
    title = next(line for line in proc.stdout.splitlines() if "L=" in line and "K=2" in line)
    assert ", bf16" in title, title


def test_default_out_is_plan_json_in_the_current_folder(tmp_path: Path, capsys) -> None:
    proc = run_cli(capsys, *plan_args(stages=4, batch=1), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert os.listdir(tmp_path) == ["plan.json"]
    assert read_plan(tmp_path / "plan.json").stages == 4


def test_options_reach_the_plan(tmp_path: Path, capsys) -> None:
    # GPipe order: the objective's optimum is compared (a split order may re-rank to a neighbour of it).
    shape = ("--seq-len", "512", "--token-step", "16", "--order", "gpipe")
    exact = run_cli(capsys, *plan_args(*shape, "--out", "exact.json"), cwd=tmp_path)
    assert exact.returncode == 0, exact.stderr
    eps = 1e-3
    approx = run_cli(
        capsys,
        *plan_args(
            *shape,
            "--method",
            "enumerate",
            "--epsilon",
            str(eps),
            "--out",
            "enum.json",
        ),
        cwd=tmp_path,
    )
    assert approx.returncode == 0, approx.stderr
    e, a = (json.loads((tmp_path / n).read_text()) for n in ("exact.json", "enum.json"))
    for obj in (e, a):
        assert (obj["seq_len"], obj["token_step"]) == (512, 16)
        assert all(sum(lengths) == 512 and all(n % 16 == 0 for n in lengths) for _, lengths in obj["slices"])
    assert a["solver"]["method"] == "enumerate" and a["solver"]["epsilon"] == eps
    assert e["predicted_s"] <= a["predicted_s"] * (1 + 1e-12) <= e["predicted_s"] + 2 * eps + 1e-12  # K·ε, K = 2


def test_data_parallel(tmp_path: Path, capsys) -> None:
    # The example profile has no data-parallel link: the replicas plan without their all-reduce, with one
    # warning line, and the plan records it (tests/test_data_parallel.py checks the numbers).
    proc = run_cli(capsys, *plan_args("--data-parallel", "2", "--out", "unpriced.json"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("warning:") == 1 and "data_parallel_link" in proc.stderr, proc.stderr
    unpriced = json.loads((tmp_path / "unpriced.json").read_text())
    assert unpriced["data_parallel_allreduce"]["priced"] is False
    obj = copy.deepcopy(RAW)
    obj["params_per_layer"] = 800_000
    obj["data_parallel_link"] = {"latency_s": 5e-5, "bytes_per_s": 1e9}
    profile = tmp_path / "dp.json"
    profile.write_text(json.dumps(obj))
    proc = run_cli(capsys, *plan_args("--data-parallel", "2", "--out", "p.json", profile=profile), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["data_parallel"] == 2 and "warning" not in proc.stderr
    assert plan["data_parallel_allreduce"]["priced"] is True
    cost = CostModel.from_profile(profile, stages=2, data_parallel=2)
    assert cost.allreduce_s > 0
    assert plan["predicted_s"] == pytest.approx(evaluate(cost, plan["slices"], 2), rel=1e-12)


def test_help_has_an_example(tmp_path: Path, capsys) -> None:
    proc = run_cli(capsys, "plan", "--help", cwd=tmp_path)
    assert proc.returncode == 0
    for flag in (
        "--profile",
        "--stages",
        "--batch",
        "--seq-len",
        "--token-step",
        "--epsilon",
        "--method",
        "--data-parallel",
        "--out",
    ):
        assert flag in proc.stdout, flag
    assert "terapipe plan --profile" in proc.stdout


# --- bad input: one line, exit 2, no traceback, no file -----------------------------------------------


def _profile_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad-profile.json"
    path.write_text(text)
    return path


BAD = [
    # (id, arguments given a tmp folder, a word stderr must contain)
    ("missing profile", lambda t: plan_args(profile=t / "nope.json"), "nope.json"),
    ("malformed JSON", lambda t: plan_args(profile=_profile_file(t, "{")), "malformed JSON"),
    ("wrong schema", lambda t: plan_args(profile=_profile_file(t, json.dumps({**RAW, "schema": "x/1"}))), "schema"),
    (
        "missing field",
        lambda t: plan_args(profile=_profile_file(t, json.dumps({k: v for k, v in RAW.items() if k != "backward_s"}))),
        "backward_s",
    ),
    (
        "unknown precision",
        lambda t: plan_args(profile=_profile_file(t, json.dumps({**RAW, "precision": "fp8"}))),
        "field 'precision'",
    ),
    ("zero stages", lambda t: plan_args(stages=0), "--stages"),
    ("negative batch", lambda t: plan_args(batch=-1), "--batch"),
    ("zero batch", lambda t: plan_args(batch=0), "--batch"),
    ("zero replicas", lambda t: plan_args("-d", "0"), "--data-parallel"),
    ("L not a multiple of g", lambda t: plan_args("--seq-len", "100"), "multiple"),
    ("more stages than layers", lambda t: plan_args(stages=5), "more than the 4 layers"),
    ("layers of the stages not summing to N", lambda t: plan_args("--layers-per-stage", "1,1"), "--layers-per-stage"),
    ("virtual stages beyond the layers", lambda t: plan_args("--virtual-stages", "4"), "--virtual-stages"),
    ("negative epsilon", lambda t: plan_args("--epsilon", "-0.5"), "--epsilon"),
    ("unknown method", lambda t: plan_args("--method", "greedy"), "--method"),
    ("L longer than the model", lambda t: plan_args("--seq-len", "2048"), "--seq-len"),
    ("stages not a number", lambda t: plan_args("--stages", "two"), "--stages"),
    ("missing --batch", lambda t: ["plan", "--profile", str(EXAMPLE), "--stages", "2"], "--batch"),
    # ZB-V runs two chunks per device in a V: what does not fit that is refused before planning, naming the option.
    (
        "zbv with one chunk per device",
        lambda t: plan_args("--order", "zbv", "--virtual-stages", "1"),
        "--virtual-stages",
    ),
    ("zbv with three chunks per device", lambda t: plan_args("--order", "zbv", "--virtual-stages", "3"), "must be 2"),
    (
        "zbv on too few layers",
        lambda t: plan_args("--order", "zbv", "--virtual-stages", "auto", stages=4),
        "--stages 3",
    ),
    ("zbv given K layer counts", lambda t: plan_args("--order", "zbv", "--layers-per-stage", "2,2"), "4 layer counts"),
    (
        "zbv with tied embeddings",
        lambda t: plan_args("--order", "zbv", "--virtual-stages", "auto", profile=_tied(t)),
        "--order: zbv",
    ),  # fmt: skip
    # With more than one chunk per device nothing is searched within the limit: the advice names what is.
    (
        "zbv over the memory limit",
        lambda t: _over_memory("--order", "zbv", "--virtual-stages", "auto"),
        "use --order auto or 1f1b",
    ),
    (
        "v = 2 over the memory limit",
        lambda t: _over_memory("--order", "1f1b", "--virtual-stages", "2"),
        "use --virtual-stages 1",
    ),
    (
        "K·v layer counts over the memory limit",
        lambda t: _over_memory("--order", "1f1b", "--layers-per-stage", "1,1,1,1"),
        "give one layer count per stage",
    ),  # fmt: skip
]


def _tied(tmp_path: Path) -> Path:
    """The example profile of a GPT-2 model (its head tied to the embedding by default)."""
    return _profile_file(tmp_path, json.dumps({**RAW, "model": {**RAW["model"], "arch": "gpt2"}}))


def _over_memory(*options: str) -> list[str]:
    """A plan of the measured profile (it has the sizes to estimate memory) under a limit nothing meets."""
    return plan_args(*options, "--memory-limit", "0.001", profile=MEASURED)


@pytest.mark.parametrize("make_args, word", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(tmp_path: Path, make_args, word: str, capsys) -> None:
    work = tmp_path / "work"
    work.mkdir()
    args = make_args(tmp_path)
    proc = run_cli(capsys, *args, "--out", work / "plan.json", cwd=work)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert word in lines[0], lines[0]
    assert os.listdir(work) == []  # no plan, no temporary file


def test_out_is_a_folder(tmp_path: Path, capsys) -> None:
    (tmp_path / "outdir").mkdir()
    proc = run_cli(capsys, *plan_args("--out", "outdir"), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "outdir" in proc.stderr
    assert os.listdir(tmp_path / "outdir") == [] and os.listdir(tmp_path) == ["outdir"]


def test_plan_out_is_checked_before_planning(tmp_path, capsys):
    """--out names a file; no folders made beyond its own; an unrelated file is kept unless --force."""
    base = ("plan", "--profile", str(EXAMPLE), "--stages", "2", "--batch", "1")
    (tmp_path / "somedir").mkdir()
    for out, message in [
        ("somedir/", "names a folder"),
        ("somedir", "names a folder"),
        ("no/such/plan.json", "folder no does not exist"),
    ]:
        p = run_cli(capsys, *base, "--out", out, cwd=tmp_path)
        assert_one_line_error(p, message)
    assert list((tmp_path / "somedir").iterdir()) == [] and not (tmp_path / "no").exists()
    (tmp_path / "notes.txt").write_text("mine")
    p = run_cli(capsys, *base, "--out", "notes.txt", cwd=tmp_path)
    assert_one_line_error(p, "notes.txt exists and is not a plan; pass --force")
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert run_cli(capsys, *base, "--out", "notes.txt", "--force", cwd=tmp_path).returncode == 0
    assert (
        run_cli(capsys, *base, "--out", "notes.txt", cwd=tmp_path).returncode == 0
    )  # now a plan: overwriting it is fine
    assert run_cli(capsys, *base, "--out", "new/plan.json", cwd=tmp_path).returncode == 0  # its own folder is made


def test_plan_table_stays_on_one_line_per_scheme_when_piped(tmp_path, capsys):
    """Piped, with no COLUMNS, rich would fit the table into 80 columns (one word per line); it gets 160."""
    p = run_cli(
        capsys,
        "plan",
        "--profile",
        str(EXAMPLE),
        "-k",
        "2",
        "-b",
        "1",
        "--out",
        str(tmp_path / "p.json"),
        env={"COLUMNS": ""},
    )
    assert p.returncode == 0, p.stderr
    rows = [line for line in p.stdout.splitlines() if line.startswith(("│ TeraPipe (DP)", "│ GPipe "))]
    assert len(rows) == 2 and all("×" in row for row in rows), p.stdout


def test_the_plan_stores_its_profile_path_absolute(tmp_path, capsys):
    """A relative --profile is stored absolute, so a report or a run started elsewhere still finds it."""
    (tmp_path / "p.json").write_text(EXAMPLE.read_text())
    p = run_cli(capsys, "plan", "--profile", "p.json", "-k", "2", "-b", "1", "--out", "plan.json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    stored = json.loads((tmp_path / "plan.json").read_text())["profile"]["path"]
    assert Path(stored).is_absolute() and Path(stored) == tmp_path / "p.json"


def test_show_schedule_prints_the_grid_and_schedule_out_writes_the_csv(tmp_path: Path, capsys) -> None:
    """--show-schedule: the plan's schedule as a stage x time grid; --schedule-out: the same actions as CSV, which
    reads back into the schedule the plan runs."""
    from terapipe_cli.schedule.schedule import Schedule, parse_schedule

    out, csv = tmp_path / "p.json", tmp_path / "order.csv"
    p = run_cli(
        capsys, *plan_args("-g", "256", "--order", "1f1b", "--show-schedule", "--schedule-out", csv, "--out", out)
    )
    assert p.returncode == 0, p.stderr
    plan = read_plan(out)
    schedule = Schedule.of_plan(plan)
    grid = p.stdout[p.stdout.index("schedule (1f1b order") :].splitlines()
    rows = [line for line in grid if line.startswith("stage ")][: plan.stages]
    for k, row in enumerate(rows):  # every action of the stage, once, in its order
        assert [c for c in row.split()[2:] if c not in ("·", "…")] == [schedule.label(a) for a in schedule[k]]
    assert parse_schedule(csv.read_text(), plan.slices, plan.stages, plan.recompute).actions == schedule.actions


def test_a_config_file_gives_the_settings_and_flags_override_it(tmp_path: Path, capsys) -> None:
    """``--config FILE``: a ``[plan]`` table of the options (keys with underscores, paths relative to the file) plans
    what the same flags plan; a flag given overrides the file's value; the file's bad key or value is one line naming
    the file and the field, and nothing is written."""
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "p.json").write_text(EXAMPLE.read_text())
    config = folder / "plan.toml"
    config.write_text('[plan]\nprofile = "p.json"\nstages = 2\nbatch = 2\norder = "1f1b"\nvirtual_stages = "1"\n')
    by_flags = run_cli(capsys, "plan", "--profile", EXAMPLE, "-k", 2, "-b", 2, "--order", "1f1b",
                       "--virtual-stages", 1, "--out", tmp_path / "flags.json")  # fmt: skip
    by_file = run_cli(capsys, "plan", "--config", config, "--out", tmp_path / "file.json")
    assert by_flags.returncode == by_file.returncode == 0, by_file.stderr
    flags, file = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("flags", "file"))
    assert file["slices"] == flags["slices"] and file["order"] == flags["order"] == "1f1b"
    assert file["profile"]["path"] == str((folder / "p.json").resolve())  # relative to the file
    over = run_cli(capsys, "plan", "-c", config, "-b", 1, "--out", tmp_path / "over.json")
    assert over.returncode == 0 and json.loads((tmp_path / "over.json").read_text())["batch_size"] == 1
    for text, words in (
        ("[plan]\nstagez = 2\n", ("plan.toml", "plan.stagez", "not a plan setting")),
        ('[plan]\nstages = "two"\n', ("plan.toml", "plan.stages")),
        ('[plan]\norder = "fast"\n', ("plan.toml", "plan.order", "gpipe")),
        ("[train]\nsteps = 2\n", ("plan.toml", "[plan]")),
    ):
        config.write_text(text)
        p = run_cli(capsys, "plan", "--config", config, "--out", tmp_path / "bad.json")
        assert_one_line_error(p, *words)
        assert not (tmp_path / "bad.json").exists()
