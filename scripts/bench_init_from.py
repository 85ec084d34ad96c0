#!/usr/bin/env python3
"""``terapipe train --init-from``: each rank's memory while it loads, and what it adds to a run's start-up.

    python scripts/bench_init_from.py                  # a ~300M random Llama, K = 2, 2 runs of each kind
    python scripts/bench_init_from.py --trials 3 --keep /tmp/src

Builds a random ``LlamaForCausalLM`` of about 300M parameters with `transformers` (H = 1024, 20 layers, 16 heads,
8 key/value heads, SwiGLU 2816, vocabulary 32000, untied head) and ``save_pretrained``s it in bf16 (safetensors).

Memory: for each of the K = 2 ranks, in a fresh process, the rank's own `Trainer` is built (its stage, its optimizer
with no state yet) and the worker's own function that starts its weights (`worker.start_weights`) runs; the peak
resident set during it (VmHWM, reset first through /proc/self/clear_refs) minus the resident set before is the
loading's extra memory. Target: at most the stage's fp32 weights plus its largest tensor.

Start-up: ``terapipe train --plan P --steps 2 --device cpu`` with and without ``--init-from``, interleaved A B A B;
start-up is from the command's start to the end of step 1 (metrics.jsonl's first record, polled every 20 ms) less
step 1's own iteration time; the run is then stopped (its processes killed by id: no checkpoint is written). Prints
the median (min-max) of each and the overhead. Target: at most 10%.

Timing holds /tmp/terapipe-cpu.lock (flock) so no other measurement on this machine runs at the same time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # local_world: the tests' ranks as threads of one process
from bench_train import cpu_lock  # noqa: E402  (this folder: one CPU-bound benchmark at a time)

SEQ_LEN = 64
STAGES = 2
LLAMA_300M = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=20,
                  num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048,
                  tie_word_embeddings=False, rope_theta=500000.0)  # fmt: skip


def build_source(folder: Path) -> int:
    """The random model saved in bf16; its parameter count."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**LLAMA_300M)
    model = transformers.LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(folder)
    return params


def write_plan(folder: Path, plan_path: Path) -> None:
    from terapipe_cli.config.model import model_from_transformers
    from terapipe_cli.files import write_json_atomic
    from terapipe_cli.plan.file import make_plan_dict

    model = model_from_transformers(folder, seq_len=SEQ_LEN, name="llama-300m")
    obj = make_plan_dict(
        model=model, stages=STAGES, batch_size=1, seq_len=SEQ_LEN, token_step=1, slices=[(1, [SEQ_LEN])]
    )
    write_json_atomic(plan_path, obj)


def rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure_rank(source: str, plan_path: str, stage: int) -> dict:
    """One rank's loading, in this (fresh) process: its own `Trainer` built (stage and optimizer, as a worker builds
    them), then the worker's own `start_weights`, with the peak resident set around it."""
    import gc

    import torch
    from local_world import LocalWorld, local_comms  # tests/: ranks as threads of this process

    from terapipe_cli.config.run import RunArguments
    from terapipe_cli.engine.data import load_data
    from terapipe_cli.engine.mesh import Layout
    from terapipe_cli.engine.trainer import Trainer
    from terapipe_cli.plan.file import read_plan
    from terapipe_cli.schedule.schedule import Schedule
    from terapipe_cli.train.init_from import open_source
    from terapipe_cli.train.worker import start_weights

    torch.set_num_threads(1)
    plan = read_plan(plan_path)
    args = RunArguments(steps=1, data=None, seed=0, lr=1e-4, data_parallel=1, checkpoint_every=10, threads=1,
                        timeout_s=60.0, verify=False, init_from=str(open_source(source).path))  # fmt: skip
    layout = Layout(1, plan.stages, 1)
    rank = layout.rank(0, stage, 0)
    comms = local_comms(LocalWorld(layout.world), layout, rank)
    trainer = Trainer(plan, Schedule.of_plan(plan), args, layout=layout, rank=rank, device=torch.device("cpu"),
                      comms=comms, data=load_data(None, None), held_out=None)  # fmt: skip
    sizes = [t.numel() * 4 for t in trainer.runner.module.state_dict().values()]
    gc.collect()
    before = rss_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the current resident set
    t = time.perf_counter()
    start_weights(trainer)
    seconds = time.perf_counter() - t
    return {
        "stage": stage,
        "extra_bytes": rss_bytes("VmHWM") - before,
        "stage_bytes": sum(sizes),
        "largest_bytes": max(sizes),
        "seconds": seconds,
    }


def startup_s(plan: Path, out: Path, init_from: Path | None) -> tuple[float, float]:
    """(start-up seconds, step 1's iteration seconds) of one ``terapipe train`` run, stopped after step 1."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
    args = [sys.executable, "-m", "terapipe_cli", "train", "--plan", str(plan), "--steps", "2", "--out", str(out),
            "--device", "cpu", "--threads", "1"]  # fmt: skip
    if init_from is not None:
        args += ["--init-from", str(init_from)]
    metrics = out / "metrics.jsonl"
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while True:
            if metrics.is_file() and metrics.read_text().strip():
                seen = time.perf_counter()
                break
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended before step 1: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.02)
    finally:
        stop_tree(proc.pid)  # no checkpoint written
        proc.wait()
    first = json.loads(metrics.read_text().splitlines()[0])
    return seen - t0 - first["iteration_s"], first["iteration_s"]


def descendants(pid: int) -> list[int]:
    """The processes started by ``pid``, and by them, ... (torchrun's agent puts its workers in sessions of their own,
    so the launcher's process group does not hold them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def stop_tree(pid: int) -> None:
    """SIGKILL the run this script started: its launcher and every process under it, each by its id."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=2, help="runs of each kind (A B A B ...)")
    parser.add_argument("--keep", type=Path, help="build the source here (reused when it is there)")
    parser.add_argument("--measure-rank", nargs=3, metavar=("SRC", "PLAN", "STAGE"), help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.measure_rank:
        print(json.dumps(measure_rank(a.measure_rank[0], a.measure_rank[1], int(a.measure_rank[2]))))
        return
    work = Path(tempfile.mkdtemp(prefix="bench-init-from-"))
    source = a.keep or work / "llama-300m"
    try:
        if not (source / "config.json").is_file():
            t = time.perf_counter()
            params = build_source(source)
            print(f"source: {params / 1e6:.1f}M parameters, bf16, built and saved in {time.perf_counter() - t:.1f} s")
        plan = work / "plan.json"
        write_plan(source, plan)
        load = os.getloadavg()
        print(f"machine: {os.cpu_count()} cores, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
        with cpu_lock():
            for stage in range(STAGES):
                p = subprocess.run(
                    [sys.executable, __file__, "--measure-rank", str(source), str(plan), str(stage)],
                    capture_output=True, text=True, check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                )  # fmt: skip
                m = json.loads(p.stdout.strip().splitlines()[-1])
                bound = m["stage_bytes"] + m["largest_bytes"]
                verdict = "ok" if m["extra_bytes"] <= bound else "OVER"
                print(
                    f"rank {stage}: loading added {m['extra_bytes'] / 2**20:.0f} MiB at its peak (stage weights "
                    f"{m['stage_bytes'] / 2**20:.0f} MiB fp32, largest tensor {m['largest_bytes'] / 2**20:.0f} MiB: "
                    f"bound {bound / 2**20:.0f} MiB) in {m['seconds']:.2f} s: {verdict}"
                )
            runs: dict[str, list[float]] = {"without": [], "with": []}
            for trial in range(a.trials):
                for kind in ("without", "with"):
                    out = work / f"run-{kind}-{trial}"
                    s, step_s = startup_s(plan, out, source if kind == "with" else None)
                    shutil.rmtree(out, ignore_errors=True)
                    runs[kind].append(s)
                    print(f"  trial {trial + 1}: {kind:>7} --init-from: start-up {s:.2f} s (step 1: {step_s:.2f} s)")
        base, loaded = statistics.median(runs["without"]), statistics.median(runs["with"])
        print(f"start-up without --init-from: {summary(runs['without'])}")
        print(f"start-up with    --init-from: {summary(runs['with'])}")
        print(f"overhead: {(loaded - base) / base:+.1%} of the start-up (median against median; target <= 10%)")
        load = os.getloadavg()
        print(f"load average after: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
