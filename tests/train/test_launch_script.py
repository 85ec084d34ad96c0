"""`terapipe launch-script`: the per-node `terapipe train` commands of a plan, and the sbatch file (train/cluster.py).

The node scripts are run for real: two processes on loopback, as two machines would run them, training into one
shared run folder. The sbatch file runs under a stand-in `srun` and `scontrol` that start its tasks one after the
other on this machine, each with its own $SLURM_NODEID, so what each node's `terapipe train` receives is checked
word for word. Bad input is one line, exit 2, and no folder.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import ROOT, assert_one_line_error, run_cli, write_plan_file

from terapipe_cli.engine.mesh import Layout
from terapipe_cli.errors import UserError
from terapipe_cli.train import cluster
from terapipe_cli.train.rundir import read_metrics

# terapipe on the "nodes": this checkout's package (sys.executable is relative when PATH has .venv/bin)
PYTHON = f"{shlex.quote(os.path.abspath(sys.executable))} -m terapipe_cli"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_env(**extra: str) -> dict:
    """The environment `test_multinode.start_node` gives a node: this checkout's package, no GPU."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    return {**env, "CUDA_VISIBLE_DEVICES": "", **extra}


@pytest.fixture
def plan(tmp_path):
    """K = 2 stages, D = T = 1: two workers, one per node."""
    return write_plan_file(tmp_path / "plan.json", [(2, [8, 8, 16])], stages=2)


def test_the_node_scripts_train_the_plan_on_two_nodes(tmp_path, plan, capsys):
    """node-0.sh and node-1.sh started as two processes train 2 steps into one shared run folder."""
    scripts, run = tmp_path / "launch", tmp_path / "run"
    port = free_port()
    p = run_cli(capsys, "launch-script", plan, "--nodes", 2, "--gpus-per-node", 1, "--rdzv-endpoint",
                f"127.0.0.1:{port}", "--run-out", run, "--steps", 2, "--device", "cpu", "--terapipe", PYTHON,
                "--out", scripts)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert sorted(f.name for f in scripts.iterdir()) == ["node-0.sh", "node-1.sh"]
    for node in (0, 1):
        script = scripts / f"node-{node}.sh"
        assert os.access(script, os.X_OK)
        assert f"--nnodes 2 --node-rank {node} --rdzv-endpoint 127.0.0.1:{port}" in script.read_text()
        assert f"node {node}: " in p.stdout and str(script) in p.stdout  # the commands and the files, printed
    procs = [
        subprocess.Popen([scripts / f"node-{node}.sh"], env=node_env(), cwd=tmp_path, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for node in (0, 1)
    ]  # fmt: skip
    results = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], results
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    assert "step     2/2" in results[0][0]


def test_the_sbatch_file_starts_one_train_per_node(tmp_path, capsys):
    """`bash -n` takes every file; under a stand-in srun each task gets its own --node-rank from $SLURM_NODEID and
    the endpoint of the allocation's first host; paths with spaces and quotes arrive as one word each."""
    folder = tmp_path / "it's a folder"
    folder.mkdir()
    plan = write_plan_file(folder / "plan.json", [(1, [16, 16]), (1, [32])], stages=2, data_parallel=2)
    scripts, run = tmp_path / "launch", folder / "run"
    p = run_cli(capsys, "launch-script", plan, "-n", 2, "-g", 2, "--slurm", "--run-out", run, "--steps", 3,
                "--terapipe", "printf '%s\\n'", "--out", scripts)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert sorted(f.name for f in scripts.iterdir()) == ["launch.sbatch", "node-0.sh", "node-1.sh"]
    for f in scripts.iterdir():
        check = subprocess.run(["bash", "-n", f], capture_output=True, text=True)
        assert check.returncode == 0, (f.name, check.stderr)
    sbatch = (scripts / "launch.sbatch").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=2"):
        assert line in sbatch.splitlines()
    assert '"$SLURM_NODEID"' in sbatch

    bin_ = tmp_path / "bin"  # srun: its options skipped, one task per node in turn; scontrol: the allocation's hosts
    bin_.mkdir()
    (bin_ / "srun").write_text('#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\n'
                               'for id in 0 1; do SLURM_NODEID=$id "$@"; echo ---; done\n')  # fmt: skip
    (bin_ / "scontrol").write_text('#!/usr/bin/env bash\n[[ "$*" == "show hostnames gpu[07-08]" ]] && '
                                   'printf "gpu07\\ngpu08\\n"\n')  # fmt: skip
    for tool in bin_.iterdir():
        tool.chmod(0o755)
    env = node_env(PATH=f"{bin_}:{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu[07-08]", SLURM_JOB_ID="1234")
    job = subprocess.run(["bash", scripts / "launch.sbatch"], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert job.returncode == 0, job.stderr
    tasks = [t.strip().splitlines() for t in job.stdout.split("---")[:2]]
    # The rendezvous port comes from the job id: 29500 + 1234 % 2000.
    common = ["train", "--plan", str(plan), "--nnodes", "2", "--rdzv-endpoint", "gpu07:30734", "--out", str(run)]
    settings = ["--steps", "3", "--precision", "fp32", "--resume-if-present"]
    assert tasks == [[*common, *settings, "--node-rank", str(node)] for node in (0, 1)]

    # Outside the allocation a node script says why it cannot find the rendezvous, in one line.
    alone = subprocess.run(["bash", scripts / "node-1.sh"], env=node_env(), capture_output=True, text=True)
    assert alone.returncode != 0 and "not in a Slurm job" in alone.stderr and alone.stdout == ""


@pytest.mark.parametrize(
    "args, words",
    [
        (
            ["-n", 2, "-g", 2, "--rdzv-endpoint", "h:1"],
            ["--nodes × --gpus-per-node", "2 × 2 = 4", "--nodes 2 --gpus-per-node 1; --nodes 1 --gpus-per-node 2"],
        ),
        (["-n", 3, "-g", 1, "--rdzv-endpoint", "h:1"], ["3 × 1 = 3 processes", "D × K × T = 1 × 2 × 1 = 2"]),
        (["-n", 2, "-g", 1, "--rdzv-endpoint", "node0"], ["--rdzv-endpoint", "no port"]),
        (["-n", 2, "-g", 1, "--rdzv-endpoint", "node0:port"], ["--rdzv-endpoint", "integer from 1 to 65535", "port"]),
        (["-n", 2, "-g", 1, "--rdzv-endpoint", "node0:70000"], ["--rdzv-endpoint", "70000"]),
        (["-n", 2, "-g", 1, "--rdzv-endpoint", ":29500"], ["--rdzv-endpoint", "no host"]),
        (["-n", 2, "-g", 1], ["--rdzv-endpoint", "required without --slurm"]),
        (["-n", 2, "-g", 1, "--slurm", "--steps", 0], ["--steps", "at least 1"]),
        (["-n", 2, "-g", 1, "--slurm", "--device", "tpu"], ["--device", "auto, cpu, cuda"]),
        (["-n", 2, "-g", 1, "--slurm", "--precision", "fp8"], ["--precision", "auto, fp32, bf16, fp16", "fp8"]),
        (
            ["-n", 2, "-g", 1, "--slurm", "--precision", "bf16"],
            ["--precision", "made for fp32", "terapipe profile --precision bf16", "accept_precision = true"],
        ),
        (["-n", 2, "-g", 1, "--slurm", "--terapipe", ""], ["--terapipe"]),
        (["-n", 2, "-g", 1, "--slurm", "--config", "absent.toml"], ["absent.toml", "not found"]),
        (["-n", 2, "-g", 1, "--slurm", "--time", "2h"], ["--time", "a Slurm time limit", "'2h'"]),
        (["-n", 2, "-g", 1, "--slurm", "--time", "0"], ["--time", "a Slurm time limit", "'0'"]),
        (["-n", 2, "-g", 1, "--slurm", "--partition", "gpu\nx"], ["--partition", "a Slurm name"]),
        (["-n", 2, "-g", 1, "--slurm", "--account", "a b"], ["--account", "a Slurm name"]),
        (["-n", 2, "-g", 1, "--rdzv-endpoint", "h:1", "--time", "60"], ["--time", "is for the sbatch file", "--slurm"]),
        (["-n", 2, "-g", 1, "--slurm", "--grace-s", 0], ["--grace-s", "positive"]),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, plan, capsys, args, words):
    out = tmp_path / "launch"
    assert_one_line_error(run_cli(capsys, "launch-script", plan, *args, "--out", out), *words)
    assert not out.exists()


def test_tensor_groups_stay_inside_a_node_and_a_missing_plan_is_named(tmp_path, capsys):
    """T = 2 on 4 processes: one per node would split a stage's tensor ranks over two machines."""
    plan = write_plan_file(tmp_path / "tp.json", [(2, [8, 8, 16])], stages=2, tensor_parallel=2)
    out = tmp_path / "launch"
    p = run_cli(capsys, "launch-script", plan, "-n", 4, "-g", 1, "--slurm", "--out", out)
    assert_one_line_error(p, "--gpus-per-node", "not a multiple of the plan's tensor-parallel T = 2",
                          "--nodes 2 --gpus-per-node 2; --nodes 1 --gpus-per-node 4")  # fmt: skip
    p = run_cli(capsys, "launch-script", tmp_path / "absent.json", "-n", 1, "-g", 1, "--slurm", "--out", out)
    assert_one_line_error(p, "absent.json", "plan not found")
    assert not out.exists()


def test_an_earlier_folder_is_replaced_only_with_force(tmp_path, plan, capsys):
    """Scripts written earlier: refused, then replaced whole with --force (node-1.sh of the old layout goes); a
    folder holding anything else is never touched."""
    out = tmp_path / "launch"
    args = ("launch-script", plan, "--slurm", "--out", out)
    assert run_cli(capsys, *args, "-n", 2, "-g", 1).returncode == 0
    assert_one_line_error(run_cli(capsys, *args, "-n", 1, "-g", 2), "--out", "pass --force")
    assert run_cli(capsys, *args, "-n", 1, "-g", 2, "--force").returncode == 0
    assert sorted(f.name for f in out.iterdir()) == ["launch.sbatch", "node-0.sh"]
    assert "#SBATCH --nodes=1" in (out / "launch.sbatch").read_text()
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".")]  # no staging folder left behind
    (out / "notes.txt").write_text("mine")
    p = run_cli(capsys, *args, "-n", 2, "-g", 1, "--force")
    assert_one_line_error(p, "--out", "not written by terapipe launch-script", "notes.txt")
    assert sorted(f.name for f in out.iterdir()) == ["launch.sbatch", "node-0.sh", "notes.txt"]


def test_layouts_and_endpoints():
    assert cluster.fitting_layouts(Layout(2, 4, 2)) == [(8, 2), (4, 4), (2, 8)]
    assert cluster.fitting_layouts(Layout(1, 3, 3)) == [(3, 3)]  # T itself: it divides none of 1, 2, 4, 8
    assert cluster.parse_endpoint("[::1]:0029400") == "[::1]:29400"
    with pytest.raises(UserError, match="IPv6 host goes in brackets"):
        cluster.parse_endpoint("::1:29400")
    places = cluster.node_places(Layout(2, 2, 2), 4)
    assert [(p.ranks, p.replicas, p.stages) for p in places] == [
        (range(0, 4), (0,), (0, 1)),
        (range(4, 8), (1,), (0, 1)),
    ]


def test_a_run_toml_is_passed_on_and_its_degrees_count(tmp_path, plan, capsys):
    """--config goes to every node (absolute); its data_parallel makes the world D × K × T = 2 × 2 × 1."""
    config = tmp_path / "run.toml"
    config.write_text("[train]\ndata_parallel = 2\nsteps = 5\n")
    out = tmp_path / "launch"
    p = run_cli(capsys, "launch-script", plan, "-n", 2, "-g", 1, "--slurm", "--config", config, "--out", out)
    assert_one_line_error(p, "D × K × T = 2 × 2 × 1 = 4 workers", "--nodes 2 --gpus-per-node 2")
    p = run_cli(capsys, "launch-script", plan, "-n", 2, "-g", 2, "--slurm", "--config", config, "--out", out)
    assert p.returncode == 0, p.stderr
    assert f"--config {config}" in (out / "node-1.sh").read_text()
    assert f"--config {config}" in (out / "launch.sbatch").read_text()
    config.write_text("[train]\nverify = true\n")
    p = run_cli(capsys, "launch-script", plan, "-n", 2, "-g", 1, "--slurm", "--config", config, "--out", out, "--force")
    assert_one_line_error(p, f"{config}: field 'train.verify'", "one machine")


def test_every_node_command_names_the_precision(tmp_path, capsys):
    """The plan's precision (train's default) written into every node's command, so that each says what it trains
    in; --precision, or the --config file's (with accept_precision), in its place."""
    plan = write_plan_file(tmp_path / "fp16.json", [(2, [8, 8, 16])], stages=2, precision="fp16")
    out = tmp_path / "launch"
    p = run_cli(capsys, "launch-script", plan, "-n", 2, "-g", 1, "--slurm", "--out", out)
    assert p.returncode == 0, p.stderr
    for name in ("node-0.sh", "node-1.sh", "launch.sbatch"):
        assert "--precision fp16" in (out / name).read_text(), name
    assert p.stdout.count("--precision fp16") == 2  # each node's command, as printed
    config = tmp_path / "run.toml"
    config.write_text('[train]\nprecision = "bf16"\naccept_precision = true\n')
    p = run_cli(capsys, "launch-script", plan, "-n", 2, "-g", 1, "--slurm", "--config", config, "--out", out, "--force")
    assert p.returncode == 0, p.stderr
    assert "--precision bf16" in (out / "node-1.sh").read_text()
    config.write_text('[train]\nprecision = "bf16"\n')
    p = run_cli(capsys, "launch-script", plan, "-n", 2, "-g", 1, "--slurm", "--config", config, "--out", out, "--force")
    assert_one_line_error(p, f"{config}: field 'train.precision'", "made for fp16", "accept_precision = true")


def test_the_sbatch_file_asks_for_gpus_only_for_a_gpu_run_and_takes_the_sites_settings(tmp_path, capsys):
    """GPUs (one per process) for --device cuda, or under auto for a plan made for a GPU; none for a plan made on a
    CPU or --device cpu (a cluster without GPUs refuses the request). --time, --partition and --account become
    #SBATCH lines; Slurm warns the job --grace-s, one predicted step and a margin before --time."""
    made = tmp_path / "cpu.json"
    p = run_cli(capsys, "plan", "--profile", ROOT / "configs/profiles/example-tiny-cpu.json", "-k", 2, "-b", 1,
                "--out", made)  # fmt: skip
    assert p.returncode == 0, p.stderr
    gpu = write_plan_file(tmp_path / "gpu.json", [(2, [8, 8, 16])], stages=2, profile={"kind": "cuda"})
    unsaid = write_plan_file(tmp_path / "unsaid.json", [(2, [8, 8, 16])], stages=2, predicted_s=2.5)
    out = tmp_path / "launch"

    def sbatch(plan, *args) -> list[str]:
        p = run_cli(capsys, "launch-script", plan, "-n", 2, "-g", 1, "--slurm", "--out", out, "--force", *args)
        assert p.returncode == 0, p.stderr
        return [line for line in (out / "launch.sbatch").read_text().splitlines() if line.startswith("#SBATCH")]

    asks = "#SBATCH --gpus-per-node=1"
    assert asks not in sbatch(made) and asks in sbatch(made, "--device", "cuda")
    assert asks in sbatch(gpu) and asks not in sbatch(gpu, "--device", "cpu")
    lines = sbatch(unsaid, "--time", "1-00:00:00", "--partition", "gpu", "--account", "proj", "--grace-s", 120)
    assert asks in lines  # a plan that does not say is taken for a GPU's
    for line in ("--time=1-00:00:00", "--partition=gpu", "--account=proj", "--requeue", "--signal=B:USR1@133"):
        assert f"#SBATCH {line}" in lines
    assert "--grace-s 120" in (out / "launch.sbatch").read_text()


def test_the_sbatch_file_forwards_the_warning_and_requeues_the_job_after_a_stop(tmp_path, capsys):
    """The job's shell under stand-ins for srun (a task that ends on SIGUSR1 or SIGTERM as a stopped train does:
    138, 143), scancel, squeue and scontrol: SIGUSR1 to the shell alone is forwarded to the steps; SIGTERM, which
    Slurm sends the steps itself, is not, and the shell outlives it; after a stop the job requeues itself while it
    is RUNNING, and not once Slurm is ending it (a cancel)."""
    plan = write_plan_file(tmp_path / "plan.json", [(1, [16, 16])], stages=2)
    scripts = tmp_path / "launch"
    p = run_cli(capsys, "launch-script", plan, "-n", 2, "-g", 1, "--slurm", "--device", "cpu", "--out", scripts)
    assert p.returncode == 0, p.stderr
    bin_, calls = tmp_path / "bin", tmp_path / "calls"
    bin_.mkdir()
    tools = {
        "srun": 'echo $$ > "$CALLS/srun.pid"; trap "exit 138" USR1; trap "exit 143" TERM; while :; do sleep 0.05; done',
        "scancel": 'echo "scancel $*" >> "$CALLS/log"; [[ $1 == --signal=USR1 ]] && kill -USR1 $(< "$CALLS/srun.pid")',
        "squeue": 'echo "$STATE"',
        "scontrol": '[[ $1 == show ]] && echo node0 || echo "scontrol $*" >> "$CALLS/log"',
    }
    for name, body in tools.items():
        (bin_ / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_ / name).chmod(0o755)

    def job(state: str, *signals: signal.Signals) -> tuple[int, list[str]]:
        """Run the sbatch file; once its srun runs, send ``signals`` to the shell, then end srun with SIGTERM."""
        calls.mkdir()
        env = node_env(PATH=f"{bin_}:{os.environ['PATH']}", SLURM_JOB_NODELIST="node0", SLURM_JOB_ID="7",
                       CALLS=str(calls), STATE=state)  # fmt: skip
        proc = subprocess.Popen(["bash", scripts / "launch.sbatch"], env=env, cwd=tmp_path, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while not (calls / "srun.pid").exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            srun = int((calls / "srun.pid").read_text())
            for s in signals:
                proc.send_signal(s)
            if signal.SIGUSR1 not in signals:
                os.kill(srun, signal.SIGTERM)  # Slurm's own TERM to the steps
            proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        log = (calls / "log").read_text().splitlines() if (calls / "log").exists() else []
        shutil.rmtree(calls)
        return proc.returncode, log

    assert job("RUNNING", signal.SIGUSR1) == (138, ["scancel --signal=USR1 7", "scontrol requeue 7"])
    assert job("RUNNING", signal.SIGTERM) == (143, ["scontrol requeue 7"])  # scancel --signal=TERM, pre-emption
    assert job("COMPLETING", signal.SIGTERM) == (143, [])  # scancel: the job ends for good
