"""The smoke tier of the architectures, orders and corpora through real torchrun workers (gloo on the CPU), once:
K = 2 processes of a grouped-query Llama walking ZB-V (process k holds chunks k and 3 − k, every backward split into I
and W, one chunk recomputed), two batch slices sliced differently, on a Megatron corpus of short documents (the
document mask on by default: the corpus records its documents, the token slices cross them); --verify against one
device with the same mask. The checkpoint holds each process's chunks under the single-device model's names
(models/llama/module.py); the timelines hold every tile's F, I and W on both chunks. Every scheme family, order,
precision and negative control is verified in one process (tests/engine/test_llama_trainer.py,
test_zero_bubble_training.py, test_documents.py)."""

from __future__ import annotations

import json

import numpy as np
from conftest import run_cli, write_plan_file

from terapipe_cli.corpus.formats import MegatronWriter
from terapipe_cli.models import LlamaConfig
from terapipe_cli.schedule.schedule import plan_tiles
from terapipe_cli.schedule.timeline import read_timeline
from terapipe_cli.train import checkpoint
from terapipe_cli.train.rundir import read_summary, timeline_path


def short_documents_corpus(prefix, *, documents: int = 400, seed: int = 0) -> None:
    """Byte-sized ids (vocab 256) in documents of 4-20 tokens, each ending with id 0."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, 21, size=documents)
    ids = np.concatenate([np.append(rng.integers(1, 256, size=n - 1), 0) for n in lengths]).astype(np.uint16)
    with MegatronWriter(prefix, np.dtype(np.uint16)) as writer:
        writer.write(ids, lengths)
        writer.commit()


def test_a_llama_on_zb_v_with_packed_documents_verifies_through_torchrun(tmp_path, capfd):
    model = LlamaConfig(
        name="test-llama", layers=4, hidden=32, heads=4, vocab=256, seq_len=32, kv_heads=2, ffn_hidden=64
    )
    slices = [(1, [20, 12]), (1, [5, 5, 22])]
    plan = write_plan_file(
        tmp_path / "plan.json", slices, stages=2, model=model, order="zbv", virtual_stages=2,
        recompute=[False, True, False, False],
    )  # fmt: skip
    short_documents_corpus(tmp_path / "docs")
    out = tmp_path / "run"
    p = run_cli(
        capfd,
        "train", "--plan", plan, "--data", tmp_path / "docs", "--steps", "2", "--out", out, "--verify",
        "--device", "cpu",
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    assert "verified" in p.stdout and read_summary(out)["verify"]["ok"] is True
    arguments = json.loads((out / "config.json").read_text())["arguments"]
    assert arguments["document_mask"] is True and arguments["eos_id"] is None

    for rank in range(2):
        _, events = read_timeline(timeline_path(out, rank))
        step = [e for e in events if e.step == 1]
        assert sorted({e.chunk for e in step}) == sorted({rank, 3 - rank})
        assert sorted(e.phase for e in step) == sorted("FIW" * 2 * len(plan_tiles(slices)))
    # Process 0 holds the V's ends (chunks 0 and 3: the embedding, the first and last layers, the head).
    ends, middle = checkpoint.load_stage(out, 2, 0)["model"], checkpoint.load_stage(out, 2, 1)["model"]
    assert ends["blocks.0.attn.k_proj.weight"].shape == (2 * 8, 32)  # kv_heads · head_dim rows
    assert {"wte.weight", "norm.weight", "lm_head.weight", "blocks.3.mlp.down_proj.weight"} <= set(ends)
    assert {"blocks.1.attn.q_proj.weight", "blocks.2.mlp.down_proj.weight"} <= set(middle)
    assert "wte.weight" not in middle and "lm_head.weight" not in middle
