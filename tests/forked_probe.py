"""A worker module for tests/engine/test_forking.py: each rank writes what it is to OUT/rank_N.json, then succeeds,
raises (on rank 1) or hangs, as ``--mode`` says."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--mode", choices=("ok", "raise", "hang"), required=True)
    a = ap.parse_args(argv)
    rank = int(os.environ["RANK"])
    seen = {"pid": os.getpid(), "session": os.getsid(0), "forked": "terapipe_cli.engine.forking" in sys.modules}
    (a.out / f"rank_{rank}.json").write_text(json.dumps(seen))
    if a.mode == "raise" and rank == 1:
        raise ValueError("the probe's failure on rank 1")
    if a.mode == "hang":  # deaf to the SIGINT its parent's death sends it, as a rank stuck in a collective is
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        time.sleep(120)
