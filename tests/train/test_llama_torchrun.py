"""The llama architecture through real torchrun workers (gloo on the CPU), once: K = 2 stages of a grouped-query model,
two batch slices sliced differently, --verify against one device; the checkpoint holds the whole stages under the
single-device model's names (engine/llama.py). Every scheme family is verified in one process
(engine/test_llama_trainer.py)."""

from __future__ import annotations

from conftest import run_cli, write_plan_file

from terapipe_cli.config.model import ModelConfig
from terapipe_cli.train import checkpoint
from terapipe_cli.train.rundir import read_summary


def test_a_llama_pipeline_verifies_through_torchrun(tmp_path, capfd):
    model = ModelConfig(
        name="test-llama", layers=4, hidden=32, heads=4, vocab=256, seq_len=32, arch="llama", kv_heads=2, ffn_hidden=64
    )
    plan = write_plan_file(tmp_path / "plan.json", [(1, [20, 12]), (1, [5, 5, 22])], stages=2, model=model)
    out = tmp_path / "run"
    p = run_cli(capfd, "train", "--plan", plan, "--steps", "3", "--out", out, "--verify", "--device", "cpu")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "verified" in p.stdout and read_summary(out)["verify"]["ok"] is True
    first, last = checkpoint.load_stage(out, 3, 0)["model"], checkpoint.load_stage(out, 3, 1)["model"]
    assert first["blocks.0.attn.k_proj.weight"].shape == (2 * 8, 32)  # kv_heads · head_dim rows
    assert "wte.weight" in first and {"norm.weight", "lm_head.weight", "blocks.3.mlp.down_proj.weight"} <= set(last)
