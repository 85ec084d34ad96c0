"""`terapipe export`: a run's stages joined into one single-device model whose logits equal the pipelined model's."""

from __future__ import annotations

import torch
from conftest import LocalSetup, assert_one_line_error, run_cli, train_locally, write_plan_file

from terapipe_cli.config.run import RunConfig
from terapipe_cli.engine.stage import StageRunner
from terapipe_cli.models.attention import KVCache
from terapipe_cli.models.gpt.module import GPT
from terapipe_cli.plan.file import plan_from_dict
from terapipe_cli.train import checkpoint
from terapipe_cli.train.export import load_exported
from terapipe_cli.train.prepare import prepare_run
from terapipe_cli.train.rundir import read_config


def trained_run(tmp_path):
    """A run folder as `terapipe train` leaves it after 3 steps: its config, and a complete checkpoint of each stage
    (trained in one process through the workers' own code, saved as a worker saves it)."""
    plan = write_plan_file(tmp_path / "plan.json", [(1, [12, 12, 8])], stages=2)
    run = tmp_path / "run"
    prepared = prepare_run(RunConfig(plan=str(plan), out=str(run), steps=3, device="cpu"))
    weights = train_locally(LocalSetup(prepared.plan, prepared.args)).weights
    for k in range(2):
        names = GPT(prepared.plan.model, k, 2).state_dict()
        checkpoint.save_stage(run, 3, k, 2, {n: weights[n] for n in names}, {})
    checkpoint.mark_complete(run, 3, 2)
    return run


def test_export_equals_the_pipelined_model(tmp_path, capsys):
    run = trained_run(tmp_path)
    out = tmp_path / "model.pt"
    p = run_cli(capsys, "export", str(run), "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "exported step 3" in p.stdout
    model, info = load_exported(out)  # strict=True inside
    assert info["step"] == 3 and isinstance(model, GPT)

    # The pipelined model: the run's two stages with their checkpointed weights, run slice by slice (stage 0 through
    # the runtime's StageRunner; the last stage's module directly, since the runner returns its loss, not logits).
    cfg, _ = read_config(run)
    pipe = plan_from_dict(cfg["plan"], "run plan")
    tokens = torch.randint(0, pipe.model.vocab, (1, 32), generator=torch.Generator().manual_seed(0))
    first = StageRunner(pipe.model, 0, 2)
    first.module.load_state_dict(checkpoint.load_stage(run, 3, 0)["model"])
    last = GPT(pipe.model, 1, 2)
    last.load_state_dict(checkpoint.load_stage(run, 3, 1)["model"])
    caches = [KVCache(pipe.model.seq_len) for _ in last.layer_ids]
    pieces, start = [], 0
    with torch.no_grad():
        for n, i in enumerate((12, 12, 8)):
            h = first.forward_tile(0, n, tokens[:, start : start + i])
            pieces.append(last(h, start, caches))
            start += i
        whole = model(tokens)
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=1e-5, atol=1e-6)


def test_export_refuses_bad_input(tmp_path, capsys):
    p = run_cli(capsys, "export", str(tmp_path), "--out", str(tmp_path / "m.pt"))
    assert_one_line_error(p, "not a run folder")
    (tmp_path / "m.pt").write_text("mine")
    p = run_cli(capsys, "export", str(tmp_path), "--out", str(tmp_path / "m.pt"))
    assert_one_line_error(p, "exists; pass --force")
    p = run_cli(capsys, "export", str(tmp_path), "--out", str(tmp_path))
    assert_one_line_error(p, "names a folder")


def test_an_interleaved_uneven_run_exports_the_same_model(tmp_path, capsys):
    """Two stages of two chunks each, the layers cut 1, 2 | 2, 1 (docs/design.md §11): each stage's checkpoint holds
    its two chunks, and the export joins them into the whole model, equal to the run's weights."""
    plan = write_plan_file(
        tmp_path / "plan.json", [(1, [12, 12, 8])], stages=2, virtual_stages=2, layers_per_stage=[1, 2, 2, 1]
    )
    run = tmp_path / "run"
    prepared = prepare_run(RunConfig(plan=str(plan), out=str(run), steps=2, device="cpu"))
    weights = train_locally(LocalSetup(prepared.plan, prepared.args)).weights
    part = prepared.plan.partition
    for k in range(2):
        names = GPT(prepared.plan.model, k, 2, partition=part, chunks=part.chunks_on(k)).state_dict()
        checkpoint.save_stage(run, 2, k, 2, {n: weights[n] for n in names}, {})
    checkpoint.mark_complete(run, 2, 2)
    out = tmp_path / "model.pt"
    assert run_cli(capsys, "export", str(run), "--out", str(out)).returncode == 0
    model, _ = load_exported(out)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, weights[name], rtol=0, atol=0)


def _flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the same size: only the checksum sees it
    path.write_bytes(bytes(data))


def test_export_and_sample_check_checksums_as_resume_does(tmp_path, capsys):
    """A bit-flipped newest checkpoint: passed over for the one before, said in one line (it exported a weight of
    −1.04e37 with exit 0 before); asked for by --step, one line and exit 2."""
    run = trained_run(tmp_path)
    for k in range(2):  # step 2: the same weights, an older complete checkpoint
        record = checkpoint.load_stage(run, 3, k)
        checkpoint.save_stage(run, 2, k, 2, record["model"], record["optimizer"])
    checkpoint.mark_complete(run, 2, 2)
    _flip_a_byte(checkpoint.stage_file(run, 3, 1))
    for command in (["export", str(run), "--out", str(tmp_path / "m.pt")], ["sample", str(run), "--tokens", "2"]):
        p = run_cli(capsys, *command)
        assert p.returncode == 0, p.stderr
        assert p.stderr.strip().splitlines()[0] == (
            "terapipe: the checkpoint of step 3 is not usable (stage_001.pt does not match its checksum): using step 2"
        )
    p = run_cli(capsys, "export", str(run), "--step", "3", "--out", str(tmp_path / "m3.pt"))
    assert_one_line_error(p, "the checkpoint of step 3 is not usable", "checksum")
    assert not (tmp_path / "m3.pt").exists()


def test_a_stage_file_of_another_model_is_one_line_everywhere(tmp_path, capsys):
    """Another model's stage file under a valid manifest: one line, exit 2, in export, sample and --resume (a
    traceback, and a worker's failure, before)."""
    from conftest import tiny_model

    run = trained_run(tmp_path)
    other = GPT(tiny_model(layers=6, hidden=48, heads=2, seq_len=32), 1, 2).state_dict()
    origin = checkpoint.Origin(tiny_model(layers=6, hidden=48, heads=2, seq_len=32).to_dict(), {})
    checkpoint.save_stage(run, 3, 1, 2, other, {}, origin=origin)
    checkpoint.mark_complete(run, 3, 2)  # a valid manifest over the foreign file
    for command in (
        ["export", str(run), "--out", str(tmp_path / "m.pt")],
        ["sample", str(run), "--tokens", "2"],
        ["train", "--resume", "--out", str(run), "--steps", "5", "--dry-run"],
    ):
        p = run_cli(capsys, *command)
        assert_one_line_error(p, "stage_001.pt", "another model")
