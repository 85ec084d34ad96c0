"""Shared fixtures and helpers: tiny models, the command run as a user runs it (in a real process, or in-process
through the same entry point), and runs trained in one process through the workers' own code.

The folders mirror the package (plan/, engine/, train/, ...). Almost everything runs in one process; the torchrun
tier (train/test_torchrun.py, train/test_interrupt.py, train/test_multinode.py, the profile's worker tests and the
demo) starts real processes. Planning tests need no PyTorch: nothing here imports it unless a test asks for it.

Tests run on the CPU, on a machine with a GPU as on one without: unless a test is marked ``gpu``, it sees no
GPU — in this process (`torch.cuda.is_available` is False, so ``--device auto`` means the CPU) and in every
process a test starts (``CUDA_VISIBLE_DEVICES=""``). GPU tests are decorated with `gpu_test` and run their
commands with ``terapipe(..., gpu=True)``.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

from terapipe_cli.models import GptConfig, ModelConfig

ROOT = Path(__file__).resolve().parents[1]
# This process's own setting, before `hide_gpus` changes it for the session (None: not set).
CUDA_VISIBLE_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES")
_REAL_CUDA: dict = {}  # torch.cuda's own is_available and device_count, while hidden


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "gpu: a test that uses the GPU (the others see none)")
    _signals_as_a_terminal_leaves_them()


def _signals_as_a_terminal_leaves_them() -> None:
    """The ending signals at their defaults and unblocked in this process (pytest's, and each xdist worker's), as a
    command typed at a terminal has them. A suite started in the background of a shell without job control (``cmd &``
    in a script) begins with SIGINT ignored, which every process it starts inherits through exec: the Ctrl-C tests
    would then test a command that rightly keeps an ignored signal ignored (as under ``nohup``)."""
    import signal

    signal.pthread_sigmask(signal.SIG_UNBLOCK, [getattr(signal, name) for name in _SIGNALS_WATCHED])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def gpu_test(fn):
    """Decorates a GPU test: marked ``gpu`` (it sees the machine's GPUs) and skipped where there is none."""
    import torch

    available = torch.cuda.is_available()  # at collection, before `hide_gpus` hides the GPU
    return pytest.mark.gpu(pytest.mark.skipif(not available, reason="needs a CUDA GPU")(fn))


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Torch in this process on one thread (when a test has loaded it): two pytest workers share two cores
    (scripts/test.sh), and two threads each would make them spin against each other (an in-process step measured
    100x slower). Processes that tests start set their own threads, as the runtime's stage processes do."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def hide_gpus():
    """The session runs as on a machine without a GPU (module docstring); `show_gpus` undoes it for a GPU test."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "")  # for the processes tests start, and for CUDA not yet initialised
        torch = sys.modules.get("torch")
        if torch is not None:  # imported during collection: CUDA may be initialised, so the variable would not do
            _REAL_CUDA.update(is_available=torch.cuda.is_available, device_count=torch.cuda.device_count)
            mp.setattr(torch.cuda, "is_available", lambda: False)
            mp.setattr(torch.cuda, "device_count", lambda: 0)
        yield


@pytest.fixture(scope="session", autouse=True)
def no_plain_progress():
    """An in-process plan whose stderr is captured (not a terminal) would print a plain progress line once it has run
    a few seconds, which a loaded machine reaches: tests that count stderr's lines must not depend on the machine's
    speed. The progress tests put the real class back with their own timings (tests/plan/test_plan_progress.py)."""
    import functools

    from terapipe_cli.cli import plan as plan_command
    from terapipe_cli.cli.console import PlainProgress

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan_command, "PlainProgress", functools.partial(PlainProgress, after_s=float("inf")))
        yield


@pytest.fixture(autouse=True)
def show_gpus(request, monkeypatch):
    """A test marked ``gpu`` sees the GPUs again, in its own process and in the ones it starts."""
    if request.node.get_closest_marker("gpu") is None:
        return
    if CUDA_VISIBLE_DEVICES is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", CUDA_VISIBLE_DEVICES)
    torch = sys.modules.get("torch")
    for name, real in _REAL_CUDA.items():
        monkeypatch.setattr(torch.cuda, name, real)


def pytest_collection_finish(session):
    """What is alive once the tests are collected (PyTorch's modules and the test modules: a few hundred thousand
    objects) frozen out of the garbage collector's sight for the session: every full collection — automatic, or a
    profile's between its timing rounds — would otherwise walk them all again (a quarter of a second each). What a
    test makes is collected as before; a test that counts live objects (gc.get_objects) sees only those."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After each test, what it leaves alive (a library it imported first — sympy, transformers, matplotlib: a
    hundred thousand objects each —, the caches of single-process runs) frozen too, once its garbage is collected:
    the automatic full collections of every later test would walk them all again (a tenth of the suite's CPU)."""
    yield
    gc.collect()
    gc.freeze()


_SIGNALS_WATCHED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1")


def _signal_state() -> tuple[dict, list]:
    import signal

    handlers = {name: signal.getsignal(getattr(signal, name)) for name in _SIGNALS_WATCHED}
    return handlers, sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))


@pytest.fixture(autouse=True)
def signal_state_kept(request):
    """The ending signals' handlers and this thread's signal mask as the test found them: a test (or the code it
    runs in this process) that leaves them changed is named in a warning, and they are put back, so that no later
    test — nor a process it starts, which inherits an ignored or blocked signal through exec — runs under them."""
    import signal
    import warnings

    handlers, blocked = _signal_state()
    yield
    after = _signal_state()
    if after == (handlers, blocked):
        return
    warnings.warn(
        f"{request.node.nodeid} left the signal state changed: {after}, was {(handlers, blocked)}", stacklevel=1
    )
    for name, handler in handlers.items():
        if handler is not None:
            signal.signal(getattr(signal, name), handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def tiny_model(layers: int = 4, hidden: int = 32, heads: int = 2, vocab: int = 256, seq_len: int = 64) -> ModelConfig:
    return GptConfig(name="test-tiny", layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq_len=seq_len)


@pytest.fixture
def tiny() -> ModelConfig:
    """4 layers, H = 32, 2 heads, byte vocabulary, L up to 64."""
    return tiny_model()


def plan_dict(slices, *, stages: int, layers: int = 6, seq_len: int = 32, model=None, **fields) -> dict:
    """A hand-made plan for a tiny model (H = 32, 2 heads; or ``model``) over ``slices``; ``fields``:
    data_parallel, tensor_parallel, precision, order, recompute."""
    from terapipe_cli.plan.file import make_plan_dict

    model = model or tiny_model(layers=layers, seq_len=seq_len)
    batch = sum(b for b, _ in slices)
    return make_plan_dict(
        model=model, stages=stages, batch_size=batch, seq_len=seq_len, token_step=1, slices=slices, **fields
    )


def write_plan_file(path, slices, *, stages: int, layers: int = 6, seq_len: int = 32, **fields):
    """`plan_dict` written to ``path``; returns the path."""
    from terapipe_cli.files import write_json_atomic

    write_json_atomic(path, plan_dict(slices, stages=stages, layers=layers, seq_len=seq_len, **fields))
    return path


def terapipe(
    *args, cwd: str | Path | None = None, env: dict | None = None, timeout: float = 240, gpu: bool = False
) -> subprocess.CompletedProcess:
    """Run ``python -m terapipe_cli ARGS`` as a user would: a real process, its exit code, stdout and stderr.

    The package is found through PYTHONPATH (so a checkout without an install works), and the terminal is a
    wide dumb one (no colour, no wrapping at 80 columns) so that assertions on output are stable. The process
    sees no GPU unless ``gpu`` (then it sees what this process was started with).
    """
    base = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    base.pop("CUDA_VISIBLE_DEVICES", None)
    if not gpu:
        base["CUDA_VISIBLE_DEVICES"] = ""
    elif CUDA_VISIBLE_DEVICES is not None:
        base["CUDA_VISIBLE_DEVICES"] = CUDA_VISIBLE_DEVICES
    return subprocess.run(
        [sys.executable, "-m", "terapipe_cli", *map(str, args)],
        cwd=cwd,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_cli(capsys, *args, env: dict | None = None, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """``terapipe ARGS`` through the command's own entry point (`terapipe_cli.cli.main`) in this process (in folder
    ``cwd``): its exit code and what it printed, as `terapipe` gives them for a real process, without a second's
    start-up. A command that starts workers runs torchrun's agent in this process, as `terapipe run` does (pass
    ``capfd`` for ``capsys`` to see what the workers print too); the environment it sets for them is undone."""
    from terapipe_cli.cli import main

    capsys.readouterr()
    environ = dict(os.environ)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLUMNS", "200")
        mp.setenv("NO_COLOR", "1")
        if cwd is not None:
            mp.chdir(cwd)
        for key, value in (env or {}).items():
            mp.setenv(key, value)
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            os.environ.clear()
            os.environ.update(environ)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["terapipe", *map(str, args)], code, out.out, out.err)


def assert_one_line_error(p: subprocess.CompletedProcess, *words: str) -> None:
    """Exit code 2, exactly one ``terapipe: error:`` line on stderr naming every word, no traceback."""
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("terapipe: error: "), p.stderr
    assert "Traceback" not in p.stderr
    for w in words:
        assert w in lines[0], lines[0]


# ---------------------------------------------------------------------------------------------------- in process


def run_arguments(**changes):
    """`RunArguments` of a short run with the whole optimizer step active: warm-up, cosine decay, clipping below
    the tiny model's gradient norm (about 1.5), a held-out part evaluated after the last step. A test-only switch
    (`config.controls.Controls`: ``kv_handback=False``, ``rope_absolute=False``, ...) goes into its ``controls``."""
    from dataclasses import fields

    from terapipe_cli.config.controls import Controls
    from terapipe_cli.config.run import RunArguments

    switches = {f.name: changes.pop(f.name) for f in fields(Controls) if f.name in changes}
    if switches:
        changes["controls"] = Controls(**switches).record()
    steps = changes.pop("steps", 3)
    base = dict(
        steps=steps, data=None, seed=0, lr=1e-3, data_parallel=1, checkpoint_every=10, threads=1, timeout_s=60.0,
        verify=True, warmup_steps=1, min_lr=1e-4, decay_steps=steps, grad_clip=0.05, val_fraction=0.1,
        eval_every=steps,
    )  # fmt: skip
    return RunArguments(**{**base, **changes})


# Two steps of a three-step schedule, for the many runs that verify one pipeline each: all that --verify compares
# is there — the first step's gradients, a step taken after an update (its loss), the weights after two updates (the
# second with Adam's moments of the first) — with the learning rate at warm-up and then mid-cosine, clipping active,
# and the held-out part evaluated after the last step; a third step would repeat the second's code path.
TWO_STEPS = {"steps": 2, "decay_steps": 3}


class LocalSetup:
    """A plan and its resolved arguments, with the data a run draws from: what `train.verify` compares against
    (its reference and spread runs), and what `train_locally` trains."""

    def __init__(self, plan, args, device: str = "cpu") -> None:
        import torch

        from terapipe_cli.engine.data import run_data

        self.plan, self.args, self.device = plan, args, torch.device(device)
        self.data, self.held_out, _ = run_data(args, seq_len=plan.seq_len, vocab=plan.model.vocab)


def local_setup(
    slices, *, stages: int, layers: int = 6, seq_len: int = 32, model=None, plan_fields=None, **args
) -> LocalSetup:
    """A tiny plan of ``slices`` on ``stages`` stages (or of ``model``; ``plan_fields``: order, recompute, ...) and
    `run_arguments` with ``args`` (data_parallel, tensor_parallel, precision, steps, kv_handback, ...)."""
    from terapipe_cli.plan.file import plan_from_dict

    fields = dict(plan_fields or {})
    for key in ("data_parallel", "tensor_parallel", "precision"):
        if key in args:
            fields.setdefault(key, args[key])
    seq_len = model.seq_len if model is not None else seq_len
    obj = plan_dict(slices, stages=stages, layers=layers, seq_len=seq_len, model=model, **fields)
    plan = plan_from_dict(obj, "test plan")
    return LocalSetup(plan, run_arguments(**args))


def train_locally(setup: LocalSetup, schedule=None, **world):
    """Train ``setup`` with every rank a thread of this process (`local_world.train_in_process`): the workers'
    own trainer, executor and collectives (``world``: `train_in_process`'s rules and group_of). Returns the
    `local_world.LocalRun`."""
    from local_world import train_in_process

    from terapipe_cli.schedule.schedule import Schedule

    schedule = schedule if schedule is not None else Schedule.of_plan(setup.plan)
    if setup.args.init_from is not None:  # --init-from: each rank starts from its share of SRC, as a worker does
        from terapipe_cli.train.worker import start_weights

        world.setdefault("start", start_weights)
    return train_in_process(
        setup.plan, schedule, setup.args, data=setup.data, held_out=setup.held_out, device=str(setup.device), **world
    )


def verify_locally(setup: LocalSetup, schedule=None, **world):
    """`train_locally`, then ``--verify``'s comparison with the single-device reference (`train.verify`)."""
    run = train_locally(setup, schedule, **world)
    return verify_local_run(run, setup), run


def verify_local_run(run, setup: LocalSetup):
    """``--verify``'s comparison (`train.verify.verify_trajectory`) of a `local_world.LocalRun` with the reference and
    the spread run of ``setup``, those two taken from `single_process_runs_of`."""
    from terapipe_cli.train.verify import Trajectory, verify_trajectory

    trajectory = Trajectory(run.losses, run.grads_step, run.grads, run.weights)
    return verify_trajectory(trajectory, setup, runs=single_process_runs_of(setup))


_SINGLE_PROCESS_RUNS: dict = {}  # `single_process_runs_of`'s, by `_single_process_key`
_PATCHING: list[bool] = [False]  # whether the running test asks for ``monkeypatch``


@pytest.fixture(autouse=True)
def note_patching(request):
    """Notes for `single_process_runs_of` whether the running test patches anything."""
    _PATCHING[0] = "monkeypatch" in request.fixturenames
    yield
    _PATCHING[0] = False


def single_process_runs_of(setup: LocalSetup):
    """``--verify``'s reference and spread run of ``setup`` (`train.verify.single_process_runs`), computed once per
    process for all that they depend on (`_single_process_key`): many tests verify other pipelines of the same model,
    seed, data, batch and steps, whose single-process runs are the same numbers. A test that patches anything (it asks
    for ``monkeypatch``: a patch may change the reference, as a negative control's does) and a run that starts from
    ``--init-from``'s file compute their own, and leave nothing here."""
    from terapipe_cli.train.verify import single_process_runs

    if _PATCHING[0] or setup.args.init_from is not None:
        return single_process_runs(setup)
    key = _single_process_key(setup)
    if key not in _SINGLE_PROCESS_RUNS:
        _SINGLE_PROCESS_RUNS[key] = single_process_runs(setup)
    return _SINGLE_PROCESS_RUNS[key]


def _single_process_key(setup: LocalSetup) -> str:
    """All that the single-process runs read (`train.verify.reference_run`, `spread_run`): the model, the batch, the
    sequence length, the loss chunks, the run's arguments but the tensor-parallel size and the test-only switches
    (both act on the stages alone), the data's tokens and documents, the device, the code path the attention and the
    optimizer take (`models.attention.forced_branch`) and, for bf16 and fp16, the plan's tiles (the spread run walks
    them)."""
    import hashlib
    from dataclasses import replace

    import torch

    from terapipe_cli.models.attention import branch

    plan, args, data = setup.plan, setup.args, setup.data
    digest = hashlib.sha256(bytes(data.tokens))
    if data.documents is not None:
        digest.update(bytes(data.documents.sequence_lengths))
        digest.update(bytes(data.documents.document_indices))
    tiles = plan.slices if args.precision != "fp32" else None
    shared = replace(args, tensor_parallel=1, controls=None)
    return repr((plan.model, plan.batch_size, plan.seq_len, plan.loss_chunk_tokens, tiles, shared,
                 data.path, data.start, data.kind, data.format, digest.hexdigest(), str(setup.device),
                 branch(torch.empty(0, device=setup.device))))  # fmt: skip


def without_accumulation(hardware):
    """``hardware`` priced as before the analytic model counted each tile's pass over the weight gradients
    (`config.hardware.Training.grad_accumulate_bytes_per_param` = 0): the plans recorded before it plan again."""
    from dataclasses import replace

    return replace(hardware, training=replace(hardware.training, grad_accumulate_bytes_per_param=0.0))


def experiment_without_accumulation(name: str, folder: Path) -> Path:
    """A copy of the experiment file ``name`` in ``folder`` whose hardware file prices no gradient accumulation
    pass (`without_accumulation`), for `terapipe plan --experiment`."""
    import tomllib

    from terapipe_cli.config.bundled import find_config

    source = Path(find_config(name, "experiments", "experiment", prefix=True))
    text = source.read_text()
    table = tomllib.loads(text)["experiment"]
    hardware = (source.parent / table["hardware"]).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    copy = folder / hardware.name
    kept = [ln for ln in hardware.read_text().splitlines() if not ln.startswith("grad_accumulate_bytes_per_param")]
    priced = "\n".join(kept).replace("[training]", "[training]\ngrad_accumulate_bytes_per_param = 0", 1)
    copy.write_text(priced + "\n")
    lines = []
    for line in text.splitlines():
        key = line.split("=", 1)[0].strip()
        if key == "hardware":
            line = f'hardware = "{copy}"'
        elif key == "model":
            line = f'model = "{(source.parent / table["model"]).resolve()}"'
        lines.append(line)
    out = folder / source.name
    out.write_text("\n".join(lines) + "\n")
    return out
