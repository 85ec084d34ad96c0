#!/usr/bin/env python3
"""Write configs/profiles/example-tiny-cpu.json: a profile made up from a formula, not measured.

It stands in for `terapipe profile` in tests and examples. The formula is a plausible single-thread CPU:
a fixed per-slice overhead (Python, kernel dispatch, K/V concatenation) plus FLOPs over a throughput,
attention over context from its 4·b·i·j·H FLOPs. Backward costs about twice the forward. Split as the runtime
runs it (schema /2), I is the input's gradients (one product per weight, attention's backward) and W the weights'
(one product per weight), each a call of its own with the backward's overhead: I + W costs one overhead more than
the whole backward. Being made up, its split is an estimate: `terapipe plan --order auto` plans no split order
from it (only from a measured profile).

    python scripts/make_example_profile.py [--model configs/models/tiny.toml] [--out PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from terapipe_cli.config.model import load_model_config  # noqa: E402
from terapipe_cli.files import write_json_atomic  # noqa: E402
from terapipe_cli.units import utc_timestamp  # noqa: E402

FLOPS_PER_S = 25e9  # one CPU core, fp32 matrix products
OVERHEAD_FWD_S = 0.35e-3  # per layer per slice
OVERHEAD_BWD_S = 0.6e-3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="configs/models/tiny.toml")
    ap.add_argument("--out", default="configs/profiles/example-tiny-cpu.json")
    args = ap.parse_args()
    model = load_model_config(args.model)
    H, L = model.hidden, model.seq_len
    step = 8
    lengths = [n for n in (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192) if n <= L]
    batches = [1, 2, 4]

    def fwd(b: int, i: int) -> float:
        # 24·H² per token for the projections and the MLP (4H), 2·i·H for causal attention within the slice.
        flops = b * i * (24 * H * H + 2 * i * H)
        return OVERHEAD_FWD_S + flops / FLOPS_PER_S

    def projections(b: int, i: int) -> float:
        return b * i * 24 * H * H / FLOPS_PER_S  # one product per weight matrix, forward or one gradient

    def backward_input(b: int, i: int) -> float:
        return OVERHEAD_BWD_S + 2 * (fwd(b, i) - OVERHEAD_FWD_S) - projections(b, i)

    profile = {
        "schema": "terapipe.profile/2",
        "source": "example",
        "note": "MADE UP from a formula by scripts/make_example_profile.py, not measured: a single-thread CPU at "
        f"{FLOPS_PER_S / 1e9:.0f} GFLOP/s with {OVERHEAD_FWD_S * 1e3:.2f}/{OVERHEAD_BWD_S * 1e3:.2f} ms "
        "forward/backward overhead per layer per slice. Use `terapipe profile` for real numbers.",
        "created": utc_timestamp(),
        "device": {"kind": "cpu", "name": "formula (example)", "threads": 1},
        "model": model.to_dict(),
        "dtype_bytes": 4,
        "token_step": step,
        "batch_sizes": batches,
        "token_lengths": lengths,
        "forward_s": [[fwd(b, i) for i in lengths] for b in batches],
        "backward_s": [[OVERHEAD_BWD_S + 2 * (fwd(b, i) - OVERHEAD_FWD_S) for i in lengths] for b in batches],
        "backward_input_s": [[backward_input(b, i) for i in lengths] for b in batches],
        "backward_weight_s": [[OVERHEAD_BWD_S + projections(b, i) for i in lengths] for b in batches],
        "context": {
            # Attention over j context tokens: 4·b·i·j·H FLOPs forward (scores and values), twice that backward,
            # plus the cost of concatenating the context keys/values (~b·j·H copies).
            "forward": {"coef": [0.05e-3, 0.0, 2 * H / 8e9, 4 * H / FLOPS_PER_S]},
            "backward": {"coef": [0.08e-3, 0.0, 4 * H / 8e9, 8 * H / FLOPS_PER_S]},
        },
        "comm": {"latency_s": 60e-6, "bytes_per_s": 2.0e9},
        "optimizer_s_per_layer": 12 * H * H * 4 * 4 / 8e9,
        "activation_bytes_per_token_per_layer": 34 * H * 4,
    }
    write_json_atomic(args.out, profile)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
