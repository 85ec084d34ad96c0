"""How well profiles made from this machine's operator table predict its tiles, for models not on the table's grid.

Times the CPU operator table (`terapipe profile --operators`), prices a profile of each model below from it (`terapipe
profile --analytic --operator-table`), then times tiles off the profile's grid through the runtime's own stage code
(`terapipe profile --check-profile`'s `measure.recheck_profile`: one decoder layer, process CPU time) and prints
predicted vs measured per tile with the mean and max relative error, and the machine's load average before and after.
The prediction is the profile's one-layer tile, ``no_context(b, i) + context(b, i, j)``, as the check's own
(`measure.check_against`). Each tile is also priced from the same table without its per-tile host terms
(``tile_host_s``), its kernels alone. With ``--steps N`` each model is also planned on its operator profile (one stage,
B = 2), trained N steps here (`terapipe train`), and the plan's simulated step compared with the measured median.

    PYTHONPATH=src python scripts/bench_operators.py [--quick] [--out-dir DIR] [--steps N]

Nothing is fitted to the tiles: the table is timed first, the profiles priced from it, the tiles timed last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# Shapes the table's grid does not hold: hidden widths, head sizes, vocabularies and lengths between its points.
MODELS = {
    "gpt-h384": {"arch": "gpt", "layers": 4, "hidden": 384, "heads": 6, "vocab": 5000, "seq_len": 384},
    "llama-gqa-h320": {
        "arch": "llama",
        "layers": 4,
        "hidden": 320,
        "heads": 8,
        "kv_heads": 2,
        "ffn_hidden": 864,
        "vocab": 3000,
        "seq_len": 384,
    },  # fmt: skip
    "gpt2-tied-h192": {"arch": "gpt2", "layers": 4, "hidden": 192, "heads": 3, "vocab": 20000, "seq_len": 256},
    "llama-mha-tied-h288": {
        "arch": "llama",
        "layers": 4,
        "hidden": 288,
        "heads": 6,
        "kv_heads": 6,
        "ffn_hidden": 768,
        "vocab": 4000,
        "seq_len": 320,
        "tie_embeddings": True,
    },  # fmt: skip
    "gpt-h256-l512": {"arch": "gpt", "layers": 4, "hidden": 256, "heads": 4, "vocab": 6000, "seq_len": 512},
    "llama-gqa4-h448": {
        "arch": "llama",
        "layers": 4,
        "hidden": 448,
        "heads": 8,
        "kv_heads": 2,
        "ffn_hidden": 1216,
        "vocab": 3000,
        "seq_len": 256,
    },  # fmt: skip
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the quick operator grid and fewer check tiles")
    parser.add_argument("--out-dir", type=Path, default=None, help="keep the table and profiles here")
    parser.add_argument(
        "--steps", type=int, default=0,
        help="also plan each model on its operator profile (K = 1, B = 2), train it this many steps here, and compare "
        "the plan's simulated step with the measured median step (the first two left out)",
    )  # fmt: skip
    args = parser.parse_args()

    import numpy as np
    import torch

    from terapipe_cli.cli import main as terapipe
    from terapipe_cli.config.demo import model_toml
    from terapipe_cli.models import ModelConfig
    from terapipe_cli.plan.costmodel import CostModel, read_profile
    from terapipe_cli.profile import measure, probe

    out = args.out_dir or Path(tempfile.mkdtemp(prefix="bench-operators-"))
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    ops = out / "operators.json"
    started = time.perf_counter()
    cpu = time.process_time()
    _run(terapipe, ["profile", "--operators", "--out", str(ops), "--force", *(["--quick"] if args.quick else [])])
    table_wall, table_cpu = time.perf_counter() - started, time.process_time() - cpu
    device = torch.device("cpu")
    print(f"\noperator table: {table_wall:.1f} s wall, {table_cpu:.1f} s CPU; load average before {load_before}")
    # The same table without its per-tile host terms: the tiles priced from their kernels alone, for comparison.
    bare = out / "operators-without-tile-host.json"
    table = json.loads(ops.read_text())
    print(f"per-tile host terms (ms): {json.dumps(table.get('tile_host_s'))}")
    table.pop("tile_host_s", None)
    bare.write_text(json.dumps(table))
    errors, errors_bare = [], []
    steps: list[tuple[str, float, float]] = []  # (model, simulated step, measured median step)
    for name, fields in MODELS.items():
        model_file, prof_file = out / f"{name}.toml", out / f"{name}.json"
        model = ModelConfig.from_dict({"name": name, **fields}, "bench_operators.py")
        model_file.write_text(model_toml(model, "scripts/bench_operators.py"))
        _run(terapipe, ["profile", "--analytic", "--operator-table", str(ops), "--model", str(model_file),
                        "--batch-sizes", "1,2", "--token-step", "16", "--out", str(prof_file), "--force"])  # fmt: skip
        prof = read_profile(prof_file)
        _run(terapipe, ["profile", "--analytic", "--operator-table", str(bare), "--model", str(model_file),
                        "--batch-sizes", "1,2", "--token-step", "16", "--out", str(out / f"{name}-bare.json"),
                        "--force"])  # fmt: skip
        cost_bare = CostModel(read_profile(out / f"{name}-bare.json"), stages=prof.model.layers)
        result = measure.recheck_profile(prof.raw, device, count=4 if args.quick else 8, repeats=3 if args.quick else 5)
        cost = CostModel(prof, stages=prof.model.layers)
        print(f"\n{name} ({probe.device_info(device)['name']}, one layer, fp32): tile   predicted   measured   "
              "error   (without the per-tile host term: predicted, error)")  # fmt: skip
        mine, mine_bare = [], []
        for r in result["points"]:
            predicted = float(cost.no_context(r["b"], r["i"]) + cost.context(r["b"], r["i"], r["j"]))
            predicted_bare = float(cost_bare.no_context(r["b"], r["i"]) + cost_bare.context(r["b"], r["i"], r["j"]))
            mine.append(abs(predicted - r["measured_s"]) / r["measured_s"])
            mine_bare.append(abs(predicted_bare - r["measured_s"]) / r["measured_s"])
            print(f"  b={r['b']} i={r['i']:4d} j={r['j']:4d}   {predicted * 1e3:8.3f} ms  "
                  f"{r['measured_s'] * 1e3:8.3f} ms  {mine[-1]:6.1%}   ({predicted_bare * 1e3:8.3f} ms  "
                  f"{mine_bare[-1]:6.1%})")  # fmt: skip
        ref = [r["measured_s"] / float(cost.no_context(r["b"], r["i"])) for r in result["reference"]["points"]]
        check = result["rel_err_mean"]
        print(
            f"  error mean {np.mean(mine):.1%}, max {max(mine):.1%}; on-grid tiles take {np.median(ref):.3f}x "
            f"their predicted time (the check's mean error {check:.1%}); "
            f"without the per-tile host term: error mean {np.mean(mine_bare):.1%}, max {max(mine_bare):.1%}"
        )
        errors += mine
        errors_bare += mine_bare
        if args.steps:
            steps.append((name, *_planned_step(terapipe, prof_file, out / name, args.steps)))
    print(f"\nall models: {len(errors)} tiles, error mean {np.mean(errors):.1%}, max {max(errors):.1%} (without the "
          f"per-tile host term: mean {np.mean(errors_bare):.1%}, max {max(errors_bare):.1%}); load average after "
          f"{os.getloadavg()}; files in {out}")  # fmt: skip
    if steps:
        print("\nplanned step (K = 1, B = 2) against the measured median step:")
        for name, simulated, measured in steps:
            print(f"  {name}: simulated {simulated * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms, "
                  f"error {abs(simulated - measured) / measured:.1%}")  # fmt: skip
        errs = [abs(s - m) / m for _, s, m in steps]
        print(f"  all: mean {np.mean(errs):.1%}, max {max(errs):.1%}; load average {os.getloadavg()}")
    return 0


def _planned_step(terapipe, profile: Path, folder: Path, steps: int) -> tuple[float, float]:
    """Plan ``profile``'s model on one stage, train it ``steps`` steps here (`terapipe train`, its own worker), and
    return the plan's simulated step and the measured median of the steps after the first two."""
    import json
    import shutil

    import numpy as np

    plan, run = folder.with_suffix(".plan.json"), folder.with_suffix(".run")
    shutil.rmtree(run, ignore_errors=True)
    _run(terapipe, ["plan", "--profile", str(profile), "--stages", "1", "--batch", "2", "--token-step", "16",
                    "--out", str(plan), "--force"])  # fmt: skip
    _run(terapipe, ["train", "--plan", str(plan), "--steps", str(steps), "--out", str(run)])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    measured = float(np.median([r["iteration_s"] for r in rows if r.get("step", 0) > 2 and "iteration_s" in r]))
    return float(json.loads(plan.read_text())["simulated_s"]), measured


def _run(terapipe, argv: list[str]) -> None:
    try:
        terapipe(argv)
    except SystemExit as e:
        if e.code:
            raise


if __name__ == "__main__":
    sys.exit(main())
