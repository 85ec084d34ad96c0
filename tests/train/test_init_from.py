"""``terapipe train --init-from SRC`` (train/init_from.py): tiny random `transformers` models saved with
``save_pretrained`` (one sharded), trained from at K = 2 and 3 (T = 2, two virtual stages) with ``--verify``'s
comparison, every rank reading its own share through the workers' own loader (`worker.start_weights`); after one step
at lr 1e-12 the ``--format hf`` folder computes the source's logits. A terapipe export and a run folder as SRC; a
wrong source is one line before anything is written; a broken name mapping fails the logits (negative control). The
command's path through real torchrun workers is test_replan.py's run through the workers: K = 2 workers read their
stages of a sharded llama folder, --verify passes, and the run is then resumed under a new plan."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch
import transformers  # an optional extra that the test set-up installs (pip install -e '.[test]')
from conftest import assert_one_line_error, local_setup, run_cli, train_locally, verify_locally, write_plan_file
from fake_runs import checkpointed_run
from hf_models import saved

from terapipe_cli.config.model import load_model_config
from terapipe_cli.engine.tensor import shard_ranges
from terapipe_cli.errors import UserError
from terapipe_cli.models import Gpt2Config, GptConfig, LlamaConfig, ModelConfig, build_model
from terapipe_cli.train.export import write_export
from terapipe_cli.train.hf import write_hf
from terapipe_cli.train.init_from import check_source, load_weights, open_source

LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8}  # fmt: skip
LLAMA = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, rope_theta=500000.0, tie_word_embeddings=False,
             rope_scaling=LLAMA31)  # fmt: skip
GPT2 = dict(vocab_size=256, n_positions=32, n_embd=32, n_layer=4, n_head=2)

# (class, config, save_pretrained's max_shard_size, stages, local_setup's settings)
CASES = {
    "llama-gqa-llama3-sharded-K2-T2": ("LlamaForCausalLM", LLAMA, "20KB", 2, {"tensor_parallel": 2}),
    "llama-tied-K3": ("LlamaForCausalLM", {**LLAMA, "num_hidden_layers": 3, "tie_word_embeddings": True}, None, 3, {}),
    "gpt2-K2-two-virtual-stages": (
        "GPT2LMHeadModel",
        GPT2,
        None,
        2,
        {"plan_fields": {"virtual_stages": 2, "layers_per_stage": [1, 1, 1, 1]}},
    ),
}


def tokens_of(cfg: ModelConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))


def source_folder(tmp_path, cls: str, config: dict, shard: str | None = None):
    """A tiny random ``cls`` saved into tmp_path/cls (sharded at ``shard``); (the model, the folder)."""
    folder = tmp_path / cls
    theirs = saved(folder, cls, **config)
    if shard is not None:
        for f in folder.glob("model*.safetensors"):
            f.unlink()
        theirs.save_pretrained(folder, max_shard_size=shard)
        assert (folder / "model.safetensors.index.json").is_file()
    return theirs, folder


@pytest.mark.parametrize("case", CASES)
def test_training_starts_from_a_transformers_folder_verified_and_exports_its_logits(tmp_path, case):
    cls, config, shard, stages, settings = CASES[case]
    theirs, folder = source_folder(tmp_path, cls, config, shard)
    cfg = load_model_config(folder)
    slices = [(1, [12, 20]), (1, [32])]
    setup = local_setup(slices, stages=stages, model=cfg, steps=2, init_from=str(folder), **settings)
    result, _ = verify_locally(setup)
    assert result.ok, [(c.what, c.max_rel, c.tolerance) for c in result.checks]

    # One step at lr 1e-12: the weights stay SRC's, and the exported folder computes SRC's logits.
    tiny_lr = dict(steps=1, lr=1e-12, min_lr=1e-12, verify=False)
    run = train_locally(local_setup(slices, stages=stages, model=cfg, init_from=str(folder), **tiny_lr, **settings))
    write_hf(tmp_path / "hf", cfg, run.weights, step=1, run=tmp_path)
    again = getattr(transformers, cls).from_pretrained(tmp_path / "hf").eval()
    tokens = tokens_of(cfg)
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, theirs(tokens).logits, rtol=1e-4, atol=1e-5)


def test_each_tensor_rank_reads_its_own_share_of_every_tensor(tmp_path):
    """T = 2: a rank's tensors are exactly its shares (`tensor.shard_ranges`) of the whole model's, read from the
    file's slices (GPT-2's transposed fused q/k/v included), never the whole tensor first."""
    for cls, config in (("LlamaForCausalLM", LLAMA), ("GPT2LMHeadModel", GPT2)):
        _, folder = source_folder(tmp_path, cls, config)
        source = open_source(folder)
        whole = build_model(source.model, seed=5)
        load_weights(source, whole)
        full = whole.state_dict()
        for rank in range(2):
            shares = {}
            for name, t in full.items():
                where = shard_ranges(name, t.shape, 2, rank)
                dim, ranges = where if where is not None else (0, [range(t.shape[0])])
                shares[name] = torch.cat([t.narrow(dim, r.start, len(r)) for r in ranges], dim)
            stage = Tensors({name: torch.zeros_like(t) for name, t in shares.items()})
            load_weights(source, stage, 2, rank)
            for name, t in stage.tensors.items():
                assert torch.equal(t, shares[name]), (cls, rank, name)


class Tensors(torch.nn.Module):
    """A stage as `load_weights` sees it: named tensors to copy into (its ``state_dict``)."""

    def __init__(self, tensors: dict) -> None:
        super().__init__()
        self.tensors = tensors

    def state_dict(self, *args, **kwargs) -> dict:
        return dict(self.tensors)


def test_a_broken_name_mapping_fails_the_logits_comparison(tmp_path, monkeypatch):
    """Negative control: q and k swapped in the llama table (multi-head, so the shapes agree) load without complaint
    and compute other logits than the source's."""
    from terapipe_cli.models.llama.spec import LlamaArch

    theirs, folder = source_folder(tmp_path, "LlamaForCausalLM", {**LLAMA, "num_key_value_heads": 4})
    source = open_source(folder)
    tokens = tokens_of(source.model)
    right = build_model(source.model, seed=1).eval()
    load_weights(source, right)
    with torch.no_grad():
        torch.testing.assert_close(right(tokens), theirs(tokens).logits, rtol=1e-4, atol=1e-5)
    swapped = {"self_attn.q_proj": "self_attn.k_proj", "self_attn.k_proj": "self_attn.q_proj"}
    keys = tuple(
        (ours, next((theirs_.replace(a, b) for a, b in swapped.items() if a in theirs_), theirs_), t)
        for ours, theirs_, t in LlamaArch.hf_keys
    )
    monkeypatch.setattr(LlamaArch, "hf_keys", keys)
    wrong = build_model(source.model, seed=1).eval()
    load_weights(source, wrong)
    with torch.no_grad(), pytest.raises(AssertionError, match="Tensor-likes are not close"):
        torch.testing.assert_close(wrong(tokens), theirs(tokens).logits, rtol=1e-4, atol=1e-5)


def test_a_gpt_export_reads_back_as_gpt_and_refuses_nonzero_biases(tmp_path):
    """``gpt`` exports as a GPT2LMHeadModel with the erf GELU and zero biases: that folder is arch gpt again, its
    weights load exactly; a nonzero bias (a GPT-2 that is not a gpt export) is one line."""
    import safetensors.torch

    model = GptConfig(name="g", layers=2, hidden=32, heads=2, vocab=256, seq_len=32)
    state = build_model(model, seed=2).state_dict()
    write_hf(tmp_path / "hf", model, state, step=0, run=tmp_path)
    source = open_source(tmp_path / "hf")
    assert source.model.arch == "gpt" and source.model.tie_embeddings is False
    check_source(source, model)
    got = build_model(model, seed=9)
    load_weights(source, got)
    assert all(torch.equal(got.state_dict()[n], t) for n, t in state.items())

    saved(tmp_path / "tied-gelu", "GPT2LMHeadModel", **GPT2, activation_function="gelu")
    with pytest.raises(UserError, match="field 'tie_word_embeddings' is True.*an LM head of its own"):
        load_model_config(tmp_path / "tied-gelu")

    path = tmp_path / "hf" / "model.safetensors"
    tensors = safetensors.torch.load_file(path)
    tensors["transformer.h.1.mlp.c_fc.bias"][3] = 0.5
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"bias 'transformer.h.1.mlp.c_fc.bias' is not zero") as err:
        check_source(source, model)
    assert "\n" not in str(err.value)


def test_an_export_and_a_run_folder_as_sources(tmp_path, capsys):
    """A terapipe export (model.pt) and a run folder (its newest checkpoint that passes its checksums; a damaged newer
    one is passed over, said in one line) give their weights, each tensor under its own name."""
    model = LlamaConfig(name="m", layers=2, hidden=32, heads=4, vocab=256, seq_len=32, kv_heads=2)
    run = checkpointed_run(tmp_path / "run", model, stages=2, step=3, seed=4)
    state = build_model(model, seed=4).state_dict()
    write_export(tmp_path / "model.pt", run, model, 3, state)
    for src in (tmp_path / "model.pt", run):
        source = open_source(src)
        check_source(source, model)
        got = build_model(model, seed=9)
        load_weights(source, got)
        assert all(torch.equal(got.state_dict()[n], t) for n, t in state.items()), src
    assert open_source(run).step == 3

    newer = checkpointed_run(tmp_path / "newer", model, stages=2, step=5, seed=6)
    (run / "checkpoints" / "step_000005").symlink_to(newer / "checkpoints" / "step_000005")
    with (newer / "checkpoints" / "step_000005" / "stage_001.pt").open("r+b") as f:
        f.seek(100)
        f.write(b"damaged")
    capsys.readouterr()
    assert open_source(run).step == 3
    assert "the checkpoint of step 5 is not usable" in capsys.readouterr().err


def test_a_wrong_source_is_one_line_before_anything_is_written(tmp_path, capsys):
    _, llama_dir = source_folder(tmp_path, "LlamaForCausalLM", LLAMA)
    _, gpt2_dir = source_folder(tmp_path, "GPT2LMHeadModel", GPT2)
    cfg = load_model_config(llama_dir)
    plan = write_plan_file(tmp_path / "plan.json", [(1, [32])], stages=2, model=cfg)
    out = tmp_path / "run"

    def train(*args):
        return run_cli(capsys, "train", "--plan", plan, "--out", out, "--device", "cpu", "--dry-run", *args)

    other_vocab = tmp_path / "vocab"
    saved(other_vocab, "LlamaForCausalLM", **{**LLAMA, "vocab_size": 512})
    assert_one_line_error(train("--init-from", other_vocab), "--init-from", "field 'model.vocab' is 512", "256")
    assert_one_line_error(train("--init-from", gpt2_dir), "field 'model.arch' is 'gpt2'", "'llama'")
    assert_one_line_error(train("--init-from", tmp_path / "nothing"), "no such file or folder")
    assert_one_line_error(train("--init-from", plan), "not a terapipe export")
    assert not out.exists()

    longer = write_plan_file(tmp_path / "long.json", [(1, [64])], stages=2, seq_len=64, model=replace(cfg, seq_len=64))
    p = run_cli(capsys, "train", "--plan", longer, "--out", out, "--device", "cpu", "--dry-run", "--init-from",
                llama_dir)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "starting from the weights of transformers folder" in p.stderr and "seq_len 32 -> 64" in p.stderr


@pytest.fixture(scope="module")
def llama_folders(tmp_path_factory):
    """A tiny llama folder whole and sharded, with a plan of its model (copied by each test that damages one)."""
    tmp = tmp_path_factory.mktemp("sources")
    source_folder(tmp, "LlamaForCausalLM", LLAMA)
    whole = tmp / "LlamaForCausalLM"
    source_folder(tmp / "sharded", "LlamaForCausalLM", LLAMA, "20KB")
    plan = write_plan_file(tmp / "plan.json", [(1, [32])], stages=2, model=load_model_config(whole))
    return whole, tmp / "sharded" / "LlamaForCausalLM", plan


def cut(path, keep):
    """The file's first ``keep`` bytes (negative: all but the last -keep), as a download stopped there leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[:keep])


@pytest.mark.parametrize(
    ("sharded", "damage", "words"),
    [
        (False, lambda f: cut(f, -1000), ["model.safetensors:", "is cut short", "its header's tensors end at byte"]),
        (False, lambda f: cut(f, 100), ["model.safetensors:", "is cut short", "fewer than its header's"]),
        (False, lambda f: cut(f, 5), ["model.safetensors:", "not a safetensors file"]),
        (False, lambda f: f.write_bytes(f.read_bytes() + b"x"), ["model.safetensors:", "1 bytes after its last"]),
        (True, lambda f: cut(f, -1), ["-of-0", ".safetensors: is cut short"]),
    ],
    ids=["data-cut", "header-cut", "no-header", "bytes-after", "one-shard-cut"],
)
def test_a_damaged_safetensors_file_is_one_line_before_the_launch(tmp_path, capsys, llama_folders, sharded, damage,
                                                                  words):  # fmt: skip
    """`terapipe train --init-from DIR` whose safetensors file a download cut short: found by its header and its size
    before any worker starts (no checksum read), one line naming the file, exit 2, no run folder."""
    whole, shards, plan = llama_folders
    folder = tmp_path / "model"
    shutil.copytree(shards if sharded else whole, folder)
    damage(sorted(folder.glob("*.safetensors"))[-1 if sharded else 0])
    out = tmp_path / "run"
    p = run_cli(capsys, "train", "--plan", plan, "--init-from", folder, "--steps", "1", "--out", out, "--device", "cpu")
    assert_one_line_error(p, *words)
    assert not out.exists()


def test_init_from_and_resume_are_one_line(tmp_path, capsys):
    p = run_cli(capsys, "train", "--resume", "--out", tmp_path, "--init-from", tmp_path)
    assert_one_line_error(p, "--init-from starts a new run", "--resume")


@pytest.mark.parametrize(
    "cfg",
    [
        GptConfig(name="g", layers=2, hidden=32, heads=2, vocab=64, seq_len=16),
        Gpt2Config(name="g2", layers=2, hidden=32, heads=2, vocab=64, seq_len=16),
        LlamaConfig(name="l", layers=2, hidden=32, heads=4, vocab=64, seq_len=16, kv_heads=2),
        LlamaConfig(name="lt", layers=2, hidden=32, heads=4, vocab=64, seq_len=16, tie_embeddings=True),
    ],
    ids=["gpt", "gpt2-tied", "llama-gqa", "llama-tied"],
)
def test_the_launcher_knows_every_tensor_shape_without_building_the_model(cfg):
    """`Arch.tensor_shapes` (what the launcher checks SRC against, torch's modules not imported) is the model's state
    dict, name for name."""
    built = {name: tuple(t.shape) for name, t in build_model(cfg).state_dict().items()}
    assert cfg.spec.tensor_shapes(cfg) == built


def test_bf16_files_become_fp32_and_a_shorter_context_takes_the_first_positions(tmp_path):
    """A bf16 folder's tensors are upcast exactly; a GPT-2 planned at half its n_positions takes the first rows of its
    position table and computes its logits there; longer than the table is one line."""
    theirs = saved(tmp_path / "bf16", "LlamaForCausalLM", **LLAMA)
    theirs.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    source = open_source(tmp_path / "bf16")
    ours = build_model(source.model, seed=3)
    load_weights(source, ours)
    names = source.model.spec.transformers_names(source.model)
    state = theirs.state_dict()
    for name, t in ours.state_dict().items():
        assert t.dtype == torch.float32 and torch.equal(t, state[names[name][0]].float()), name

    gpt2, folder = source_folder(tmp_path, "GPT2LMHeadModel", GPT2)
    short = replace(load_model_config(folder), seq_len=16)
    source = open_source(folder)
    assert "seq_len 32 -> 16" in check_source(source, short)
    ours = build_model(short, seed=3).eval()
    load_weights(source, ours)
    tokens = tokens_of(short)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), gpt2(tokens).logits, rtol=1e-4, atol=1e-5)
    with pytest.raises(UserError, match="learned 32 positions; the plan's seq_len 64 needs more"):
        check_source(source, replace(short, seq_len=64))
