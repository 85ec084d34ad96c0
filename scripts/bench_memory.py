#!/usr/bin/env python3
"""Memory benchmarks of the last stage's head and of the estimate (docs/results.md).

    .venv/bin/python scripts/bench_memory.py --part grid [--cases N] [--only NAME]
    .venv/bin/python scripts/bench_memory.py --part device [--device cuda] [--markdown FILE]
    .venv/bin/python scripts/bench_memory.py --part trace --model-json M.json --precision fp32 --out T.json
    .venv/bin/python scripts/bench_memory.py --part chunking [--seq-len 32768 --vocab 32768] [--repeats N]

``--part chunking``: the chunked LM head and cross-entropy against the unchunked one: the last stage's peak memory and
step time, side by side, interleaved (`part_chunking`).

``--part grid``: the memory estimate of a traced profile (`profile.memtrace`, read by `plan.memory`) against the
live bytes of the same step walked by the runtime's StageRunner on fake tensors (`memtrace.tracked_step_peaks`),
per device, over shapes and schemes the trace was not fitted on: vocabularies of 256 to 152K, L up to 32K at small
widths, grouped-query attention, tied embeddings, recomputation, GPipe, 1F1B, ZB-H1 and ZB-V, T = 2, D = 2 (each
replica's devices hold what D = 1's do), fp32 and bf16. Fake tensors cost no memory, so the shapes may be large;
the time is the ops' (a trace is a minute or two of CPU whatever the shapes, a step a few seconds). One line per
case and device: estimate, tracked peak, their difference. Targets: within 5%, never more than 2% under.

``--part trace``: trace one model and write its ``memory`` entry (the test data tests/data/memtrace-*.json).

``--part device``: the estimate against a real step on this machine's device (scripts/gpu_bringup.sh's
memory-trace step): per case one device runs the whole cut model (K = 1) for one step's actions, and what it
allocated beyond its weights and gradients (``torch.cuda.max_memory_allocated``; on the CPU the tracker's live
bytes of the real tensors) stands next to the traced estimate. A case whose estimated total (state, Adam's moments
included, and activations) fits the memory a process can use (the hardware file's ``memory_bytes`` less its
``reserved_bytes``: the CUDA context and NCCL's buffers) must run without running out of memory. On CUDA the
table also gives what the caching allocator reserved for the step (``torch.cuda.max_memory_reserved`` above what it
held before: its segments, with what their blocks leave unused) and the estimate's error against it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Case:
    name: str
    model: dict  # ModelConfig fields
    slices: list  # [(b, [token slice lengths])]
    stages: int
    order: str
    recompute: list
    precision: str = "fp32"
    tensor_parallel: int = 1
    placement: str | None = None  # "v" for ZB-V


def _gpt(vocab: int, L: int, hidden: int = 64, heads: int = 4, layers: int = 4, **kw) -> dict:
    return {"name": f"gpt-v{vocab}-l{L}", "layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab,
            "seq_len": L, **kw}  # fmt: skip


def _llama(vocab: int, L: int, kv_heads: int = 2, **kw) -> dict:
    kw.setdefault("ffn_hidden", 3 * kw.get("hidden", 64))  # a Llama names its MLP width; SwiGLU's ~8/3·H, rounded up
    return _gpt(vocab, L, arch="llama", kv_heads=kv_heads, **kw) | {"name": f"llama-v{vocab}-l{L}"}


_GPT1B = {"hidden": 2048, "heads": 16, "layers": 2}  # GPT3-1B's widths, two layers


def grid_cases() -> list[Case]:
    """The grid: at least 20 shapes x schemes."""
    return [
        Case("V=256 GPipe sliced", _gpt(256, 1024), [(1, [512, 256, 256])] * 2, 2, "gpipe", [False, False]),
        Case("V=256 1F1B bf16", _gpt(256, 1024), [(1, [512, 512])] * 3, 2, "1f1b", [False, False], "bf16"),
        Case("V=32K whole", _gpt(32768, 2048), [(1, [2048])], 2, "gpipe", [False, False]),
        Case("V=50K sliced recomputed", _gpt(50257, 2048), [(2, [1024, 512, 512])], 2, "gpipe", [True, True]),
        Case("V=65K L=4K K=1", _gpt(65536, 4096, layers=2), [(1, [4096])], 1, "gpipe", [False]),
        Case("V=65K L=4K K=1 sliced", _gpt(65536, 4096, layers=2), [(1, [1024] * 4)], 1, "gpipe", [False]),
        Case("V=128K L=8K bf16", _llama(128256, 8192), [(1, [2048] * 4)], 2, "gpipe", [False, False], "bf16"),
        Case("V=128K L=32K sliced bf16", _llama(128256, 32768), [(1, [8192] * 4)], 2, "1f1b", [False, False], "bf16"),
        Case("V=128K L=32K recomputed", _llama(128256, 32768), [(1, [4096] * 8)], 2, "gpipe", [True, True], "bf16"),
        Case("V=152K L=4K bf16 whole", _llama(151936, 4096), [(2, [4096])], 2, "gpipe", [False, False], "bf16"),
        Case("V=152K L=4K sliced", _llama(151936, 4096), [(2, [1024] * 4)], 2, "gpipe", [False, False]),
        Case(
            "GQA 8:1 1F1B", _llama(32000, 4096, heads=8, kv_heads=1), [(1, [2048, 2048])] * 3, 2, "1f1b", [False, False]
        ),  # fmt: skip
        Case(
            "tied K=2",
            _gpt(50257, 2048, arch="gpt2", tie_embeddings=True),
            [(1, [1024, 1024])] * 2,
            2,
            "gpipe",
            [False, False],
        ),  # fmt: skip
        Case(
            "tied K=1 bf16",
            _gpt(50257, 2048, arch="gpt2", tie_embeddings=True, layers=2),
            [(1, [2048])],
            1,
            "gpipe",
            [False],
            "bf16",
        ),  # fmt: skip
        Case("ZB-H1", _gpt(32768, 2048), [(1, [1024, 512, 512])] * 4, 2, "zb1p", [False, False]),
        Case(
            "ZB-H1 bf16 recomputed 0",
            _gpt(32768, 2048),
            [(2, [512] * 4), (1, [1024, 1024])],
            2,
            "zb1p",
            [True, False],
            "bf16",
        ),  # fmt: skip
        Case("ZB-V", _gpt(32768, 2048), [(1, [1024, 1024])] * 3, 2, "zbv", [False] * 4, placement="v"),
        Case(
            "3 stages 1F1B unequal",
            _gpt(16384, 2048, layers=6),
            [(2, [512] * 4), (1, [1024, 512, 512])],
            3,
            "1f1b",
            [True, False, False],
        ),  # fmt: skip
        Case("T=2", _gpt(50257, 2048), [(1, [1024, 1024])] * 2, 2, "gpipe", [False, False], tensor_parallel=2),
        Case(
            "T=2 bf16 recomputed",
            _llama(128256, 4096),
            [(1, [1024] * 4)],
            2,
            "gpipe",
            [True, True],
            "bf16",
            tensor_parallel=2,
        ),  # fmt: skip
        Case("D=2 (a replica)", _gpt(50257, 2048), [(1, [1024, 1024])] * 2, 2, "1f1b", [False, False]),
        Case(
            "L=32K small width whole",
            _gpt(4096, 32768, hidden=32, heads=2, layers=2),
            [(1, [32768])],
            1,
            "gpipe",
            [False],
        ),  # fmt: skip
        # GPT3-1B's widths (the device part's case): tiles of 2,048 to 8,192 tokens past the head's chunk.
        Case("GPT3-1B B=4 whole bf16", _gpt(50257, 2048, **_GPT1B), [(4, [2048])], 1, "gpipe", [False], "bf16"),
        Case("GPT3-1B B=1 whole bf16", _gpt(50257, 2048, **_GPT1B), [(1, [2048])], 1, "gpipe", [False], "bf16"),
        Case("GPT3-1B B=2 halves bf16", _gpt(50257, 2048, **_GPT1B), [(2, [1024] * 2)], 1, "gpipe", [False], "bf16"),
    ]


_TRACES: dict = {}


def _traced(model, precision: str, tensor_parallel: int):
    """The model's traced memory (once per model, precision and T in this run)."""
    from terapipe_cli.plan.traced import traced_from_dict
    from terapipe_cli.profile.memtrace import trace_memory

    key = (json.dumps(model.to_dict(), sort_keys=True), precision, tensor_parallel)
    if key not in _TRACES:
        _TRACES[key] = traced_from_dict(
            trace_memory(model, precision=precision, tensor_parallel=tensor_parallel), "trace"
        )
    return _TRACES[key]


def run_case(case: Case) -> list[tuple[float, float]]:
    """(estimate, tracked) per device."""
    from terapipe_cli.models import ModelConfig
    from terapipe_cli.plan.costmodel import read_profile
    from terapipe_cli.plan.memory import stage_memory
    from terapipe_cli.profile.memtrace import tracked_step_peaks
    from terapipe_cli.schedule.partition import Partition
    from terapipe_cli.schedule.schedule import Schedule

    model = ModelConfig.from_dict(case.model, case.name)
    base = read_profile(ROOT / "configs" / "profiles" / "tiny-cpu-measured.json")
    prof = replace(
        base, model=model, precision=case.precision, tensor_parallel=case.tensor_parallel, vocab_parallel=True,
        params_per_layer=model.params_per_layer(case.tensor_parallel), activation_bytes_per_token_per_layer=None,
        memory=_traced(model, case.precision, case.tensor_parallel),
    )  # fmt: skip
    partition = None
    if case.placement == "v":
        per = model.layers // (2 * case.stages)
        partition = Partition((per,) * (2 * case.stages), case.stages, "v")
    schedule = Schedule.build(case.slices, case.stages, case.order, case.recompute, partition)
    estimate = [m.activation_bytes for m in stage_memory(schedule, prof)]
    tracked = tracked_step_peaks(model, schedule, precision=case.precision, tensor_parallel=case.tensor_parallel)
    return list(zip(estimate, tracked, strict=True))


def part_grid(args) -> int:
    cases = [c for c in grid_cases() if not args.only or args.only in c.name][: args.cases]
    worst_over = worst_under = 0.0
    print(f"{'case':32} {'dev':>3} {'estimate MiB':>13} {'tracked MiB':>12} {'diff':>7}  seconds")
    for case in cases:
        started = time.perf_counter()
        rows = run_case(case)
        seconds = time.perf_counter() - started
        for k, (est, got) in enumerate(rows):
            diff = (est - got) / got
            worst_over, worst_under = max(worst_over, diff), min(worst_under, diff)
            mib = f"{est / 2**20:>13.1f} {got / 2**20:>12.1f}"
            print(f"{case.name:32} {k:>3} {mib} {100 * diff:>+6.1f}%  {seconds:.0f}", flush=True)
    print(f"largest over: {100 * worst_over:+.1f}%, largest under: {100 * worst_under:+.1f}% "
          f"(targets: within 5%, at most 2% under)")  # fmt: skip
    return 0 if worst_over <= 0.05 and worst_under >= -0.02 else 1


def device_cases(cuda: bool) -> list[Case]:
    """At least six shapes, one long-context with a 128K vocabulary whole and sliced; two tiny ones without CUDA."""
    if not cuda:
        # A dry run: the test data's traced model (no trace to make), one step of each path the cases below take
        # (a tile's activations kept for the backward, or recomputed in it; token-sliced, two batch slices).
        m = _gpt(1024, 256, layers=2) | {"name": "mem"}
        return [
            Case("dry sliced B=2", m, [(2, [128, 128])], 1, "gpipe", [False], "bf16"),
            Case("dry recomputed two batch slices", m, [(1, [128, 128])] * 2, 1, "gpipe", [True], "bf16"),
        ]
    llama8b = {"hidden": 4096, "heads": 32, "kv_heads": 8, "layers": 2, "ffn_hidden": 14336}
    qwen15 = {"hidden": 1536, "heads": 12, "kv_heads": 2, "layers": 2, "ffn_hidden": 8960}
    gpt1b = _GPT1B
    return [
        Case(
            "llama3-8b L=32K V=128K whole",
            _llama(128256, 32768, **llama8b),
            [(1, [32768])],
            1,
            "gpipe",
            [False],
            "bf16",
        ),  # fmt: skip
        Case(
            "llama3-8b L=32K V=128K sliced",
            _llama(128256, 32768, **llama8b),
            [(1, [8192] * 4)],
            1,
            "gpipe",
            [False],
            "bf16",
        ),  # fmt: skip
        Case("1.5B-wide L=4K V=152K B=2", _llama(151936, 4096, **qwen15), [(2, [4096])], 1, "gpipe", [False], "bf16"),
        Case(
            "1.5B-wide L=4K V=152K sliced",
            _llama(151936, 4096, **qwen15),
            [(2, [1024] * 4)],
            1,
            "gpipe",
            [False],
            "bf16",
        ),  # fmt: skip
        Case("gpt3-1b L=2K B=4", _gpt(50257, 2048, **gpt1b), [(4, [2048])], 1, "gpipe", [False], "bf16"),
        Case(
            "gpt3-1b L=2K recomputed sliced",
            _gpt(50257, 2048, **gpt1b),
            [(2, [512] * 4)] * 2,
            1,
            "gpipe",
            [True],
            "bf16",
        ),  # fmt: skip
    ]


def _stored_trace(model, precision: str, cuda: bool) -> dict | None:
    """The test data's trace (tests/data/memtrace-PRECISION.json) when it is of this model (any depth) on the CPU."""
    path = ROOT / "tests" / "data" / f"memtrace-{precision}.json"
    if cuda or not path.exists():
        return None
    obj = json.loads(path.read_text())
    stored = obj.pop("model")
    same = {k: v for k, v in stored.items() if k != "layers"} == {
        k: v for k, v in model.to_dict().items() if k != "layers"
    }
    return obj if same else None


def run_on_device(case: Case, device: str, usable_bytes: float | None) -> dict:
    """One step of ``case``'s actions on the device, against the traced estimate."""
    import torch

    from terapipe_cli.engine.live import LiveBytes
    from terapipe_cli.engine.stage import StageRunner
    from terapipe_cli.models import ModelConfig
    from terapipe_cli.plan.costmodel import read_profile
    from terapipe_cli.plan.memory import stage_memory
    from terapipe_cli.profile.memtrace import trace_memory
    from terapipe_cli.schedule.schedule import Schedule

    cuda = device == "cuda"
    model = ModelConfig.from_dict(case.model, case.name)
    key = (json.dumps(model.to_dict(), sort_keys=True), case.precision, cuda)
    if key not in _TRACES:
        from terapipe_cli.plan.memory import loss_chunk_tokens
        from terapipe_cli.plan.traced import traced_from_dict

        # The head's chunk the runner below takes (a GPU's from its memory), traced with it.
        chunk = loss_chunk_tokens(model.vocab, torch.cuda.get_device_properties(0).total_memory if cuda else None)
        _TRACES[key] = traced_from_dict(
            _stored_trace(model, case.precision, cuda)
            or trace_memory(model, precision=case.precision, cuda=cuda, loss_chunk_tokens=chunk),
            "trace",
        )
    base = read_profile(ROOT / "configs" / "profiles" / "tiny-cpu-measured.json")
    prof = replace(
        base, model=model, precision=case.precision, tensor_parallel=1, vocab_parallel=True,
        params_per_layer=model.params_per_layer(1), activation_bytes_per_token_per_layer=None, memory=_TRACES[key],
    )  # fmt: skip
    schedule = Schedule.build(case.slices, 1, case.order, case.recompute)
    est = stage_memory(schedule, prof)[0]
    row = {"case": case.name, "estimate": est.activation_bytes, "estimated_total": est.total_bytes}
    runner = StageRunner(model, 0, 1, device=device, precision=case.precision, recompute=case.recompute[0])
    params = list(runner.module.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    state = sum(p.numel() * p.element_size() for p in params)
    tokens = torch.randint(0, model.vocab, (sum(b for b, _ in case.slices), model.seq_len + 1), device=device)
    live = LiveBytes()
    try:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before, reserved_before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        with live if not cuda else nullcontext(), runner.step():
            for a in schedule[0]:
                t = a.tile
                rows = slice(t.batch_start, t.batch_start + t.batch_size)
                if a.phase == "F":
                    x = tokens[rows, t.token_start : t.token_start + t.tokens]
                    y = tokens[rows, t.token_start + 1 : t.token_start + t.tokens + 1]
                    runner.forward_tile(t.batch_slice, t.token_slice, x, y)
                elif a.phase == "W":
                    runner.backward_weight(t.batch_slice, t.token_slice)
                else:
                    (runner.backward_input if a.phase == "I" else runner.backward_tile)(
                        t.batch_slice, t.token_slice, None
                    )
        if cuda:
            torch.cuda.synchronize()
            row["measured"] = float(torch.cuda.max_memory_allocated() - before)
            # What the caching allocator held for it: its segments, with what their blocks leave unused.
            row["reserved"] = float(torch.cuda.max_memory_reserved() - reserved_before)
        else:
            row["measured"] = float(live.peak)
        row["outcome"] = "ran"
    except torch.OutOfMemoryError:
        row["measured"], row["outcome"] = None, "out of memory"
    # Adam's two moments are not allocated in this step: the state a training step would hold besides.
    held = 2 * state + 2 * sum(p.numel() * 4 for p in params)
    row["fits_estimated"] = usable_bytes is None or est.total_bytes <= usable_bytes
    row["fits_measured"] = row["measured"] is not None and (
        usable_bytes is None or row["measured"] + held <= usable_bytes
    )
    del runner, params
    return row


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _mib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def part_device(args) -> int:
    import torch

    from terapipe_cli.config.hardware import load_hardware

    cuda = args.device == "cuda" and torch.cuda.is_available()
    usable, notes = None, []
    if cuda:
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # the context made, nothing of ours allocated
        free, total = torch.cuda.mem_get_info()
        notes.append(f"CUDA context and start-up: {(total - free - torch.cuda.memory_reserved()) / 2**20:.0f} MiB of "
                     f"{total / 2**20:.0f} MiB (mem_get_info before any step)")  # fmt: skip
        hw = load_hardware(args.hardware)
        total = float(torch.cuda.get_device_properties(0).total_memory)
        usable = min(total, hw.device.memory_bytes) - float(getattr(hw.device, "reserved_bytes", 0.0) or 0.0)
    lines = [
        "| case | estimate (activations) | measured | error | outcome | estimated to fit | fits | reserved | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    missed = broken = 0
    for case in [c for c in device_cases(cuda) if args.only is None or args.only in c.name]:
        row = run_on_device(case, "cuda" if cuda else "cpu", usable)
        est, got, reserved = row["estimate"], row["measured"], row.get("reserved")
        err = (est - got) / got if got else None
        missed += err is not None and not -0.02 <= err <= 0.05
        broken += row["fits_estimated"] and row["outcome"] != "ran"
        lines.append(
            f"| {case.name} | {_mib(est)} | {'-' if got is None else _mib(got)} | "
            f"{'-' if err is None else f'{100 * err:+.1f}%'} | {row['outcome']} | "
            f"{'yes' if row['fits_estimated'] else 'no'} | {'yes' if row['fits_measured'] else 'no'} | "
            f"{_mib(reserved) if reserved else '-'} | {_pct((est - reserved) / reserved) if reserved else '-'} |"
        )
        print(lines[-1], flush=True)
        if args.markdown:  # after every case: a run stopped by a time-out keeps the cases it measured
            Path(args.markdown).write_text("\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n")
    print(f"{missed} case(s) outside the targets (within 5%, at most 2% under); {broken} estimated to fit did not run")
    print(*notes, sep="\n")
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n")
    return 0 if broken == 0 else 1  # a miss of the targets is a result; a plan that does not fit is a failure


def part_trace(args) -> int:
    from terapipe_cli.models import ModelConfig
    from terapipe_cli.profile.memtrace import trace_memory

    model_obj = json.loads(Path(args.model_json).read_text())
    model = ModelConfig.from_dict(model_obj, args.model_json)
    entry = trace_memory(model, precision=args.precision, tensor_parallel=args.tensor_parallel)
    entry["model"] = model.to_dict()
    Path(args.out).write_text(json.dumps(entry, indent=1) + "\n")
    print(f"wrote {args.out}: held-out error {100 * entry['heldout_rel_err_max']:.1f}% ({entry['heldout_worst']})")
    return 0


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def chunking_worker(seq_len: int, vocab: int, hidden: int, chunk: int, steps: int, precision: str) -> dict:
    """One process's runs of the last stage (``--part chunking``): the step's peak resident set above the process's
    size before it (VmHWM − VmRSS), the most the stage kept for the backward (`SavedBytes`), the timed steps."""
    import torch

    from terapipe_cli.engine.stage import StageRunner
    from terapipe_cli.models import GptConfig

    torch.set_num_threads(1)
    cfg = GptConfig(name="bench-head", layers=2, hidden=hidden, heads=2, vocab=vocab, seq_len=seq_len)
    runner = StageRunner(cfg, 1, 2, precision=precision, loss_chunk_tokens=chunk)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, seq_len, hidden, generator=gen)
    targets = torch.randint(0, vocab, (1, seq_len), generator=gen)
    runner.set_loss_scale(1.0 / seq_len)
    start = _rss_bytes("VmRSS")
    times, kept = [], 0
    for step in range(steps + 1):
        runner.module.zero_grad(set_to_none=False)
        t0 = time.perf_counter()
        with runner.step():
            runner.forward_tile(0, 0, x, targets)
            runner.backward_tile(0, 0, None)
        if step:  # the first step warms up
            times.append(time.perf_counter() - t0)
        kept = max(kept, runner.saved.take_peak())
        runner.reset()
    return {"peak_above_start": _rss_bytes("VmHWM") - start, "kept": kept, "times": times}


def part_chunking(args) -> int:
    """The chunked LM head and cross-entropy (engine/loss.py) against the unchunked one, on the last stage of a
    small-width model with a long sequence and a large vocabulary (default L = 8,192, V = 131,072, H = 64, one layer,
    b = 1, the whole sequence as one tile). Each run is its own process (its peak resident set is its own): one step
    to warm up, then ``--steps`` timed, the variants in the order A B A B … so that a loaded machine slows both
    alike. Per variant: the peak above the process's size before the first step (the logits are the bulk of it),
    what the stage kept for the backward, the step's seconds (median, min–max over every timed step); the ratios."""
    import statistics
    import subprocess

    from terapipe_cli.plan.memory import loss_chunk_tokens

    chunk = args.chunk or loss_chunk_tokens(args.vocab)
    variants = {"unchunked": 0, f"chunks of {chunk}": chunk}
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, c in variants.items():  # interleaved: A B A B ...
            cmd = [sys.executable, __file__, "--part", "chunking", "--worker", str(c), "--seq-len", str(args.seq_len),
                   "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--steps", str(args.steps),
                   "--precision", args.precision]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        f"The last stage's head and loss: L = {args.seq_len}, V = {args.vocab}, H = {args.hidden}, one layer, b = 1, "
        f"the whole sequence as one tile, {args.precision}, one CPU thread; {args.repeats} processes per variant, "
        f"{args.steps} timed steps each, interleaved"
    )
    print(f"{'variant':<18} {'peak above start':>18} {'kept for backward':>18} {'step s, median (min-max)':>28}")
    rows = {}
    for name, runs in results.items():
        peak = statistics.median(r["peak_above_start"] for r in runs)
        kept = statistics.median(r["kept"] for r in runs)
        times = [t for r in runs for t in r["times"]]
        rows[name] = (peak, kept, statistics.median(times))
        span = f"{statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f})"
        print(f"{name:<18} {peak / 2**20:>14.0f} MiB {kept / 2**20:>14.0f} MiB {span:>28}")
    (p0, k0, t0), (p1, k1, t1) = rows.values()
    print(f"chunked / unchunked: peak {p1 / p0:.2f}x, kept {k1 / k0:.2f}x, step time {t1 / t0:.3f}x")
    return 0


# Each part a function of the parsed arguments (``--part chunking``, the chunked head's memory and time, beside these).
PARTS = {"grid": part_grid, "trace": part_trace, "device": part_device, "chunking": part_chunking}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=sorted(PARTS), required=True)
    p.add_argument("--cases", type=int, default=None, help="grid: the first N cases only")
    p.add_argument("--only", default=None, help="grid, device: the cases whose name holds this")
    p.add_argument("--model-json", help="trace: the model's fields (JSON)")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--tensor-parallel", type=int, default=1)
    p.add_argument("--out", help="trace: where to write")
    p.add_argument("--device", default="cuda", help="device: cuda (the CPU when there is none) or cpu")
    p.add_argument("--hardware", default="h100-bf16-calibrated", help="device: the hardware file of the usable memory")
    p.add_argument("--markdown", help="device: also write the table here")
    p.add_argument("--seq-len", type=int, default=8192, help="chunking: L")
    p.add_argument("--vocab", type=int, default=131072, help="chunking: V")
    p.add_argument("--hidden", type=int, default=64, help="chunking: H")
    p.add_argument("--chunk", type=int, default=None, help="chunking: tokens per chunk (default: the runtime's)")
    p.add_argument("--repeats", type=int, default=2, help="chunking: processes per variant")
    p.add_argument("--steps", type=int, default=1, help="chunking: timed steps per process, after one to warm up")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # chunking: one process's run
    args = p.parse_args(argv)
    if args.worker is not None:
        w = chunking_worker(args.seq_len, args.vocab, args.hidden, args.worker, args.steps, args.precision)
        print(json.dumps(w))
        return 0
    return PARTS[args.part](args)


if __name__ == "__main__":
    from terapipe_cli.ending import entry_point

    entry_point(main)
