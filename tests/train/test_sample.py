"""`terapipe sample`: cached generation equals recomputing the whole sequence, the run's tokenizer, bad arguments."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch
from conftest import assert_one_line_error, run_cli, tiny_model
from fake_runs import checkpointed_run, make_run

from terapipe_cli.models import Gpt2Config, LlamaConfig, RopeScaling, build_model
from terapipe_cli.models.attention import KVCache
from terapipe_cli.models.gpt.module import GPT
from terapipe_cli.train.sample import Sampling, generate, pick, run_tokenizer


def recomputed(model, prompt: list[int], sampling: Sampling, vocab: int) -> tuple[list[int], list[torch.Tensor]]:
    """The same generation without a cache: the whole sequence forward again for every new token."""
    generator = torch.Generator().manual_seed(sampling.seed)
    seq, logits_seen = list(prompt), []
    with torch.no_grad():
        for _ in range(sampling.tokens):
            logits = model(torch.tensor([seq]))[0, -1, :vocab]
            logits_seen.append(logits)
            seq.append(pick(logits, sampling, generator))
    return seq[len(prompt) :], logits_seen


# Every architecture: the GPT, GPT-2 (biases, the tanh GELU), and a Llama with grouped-query attention (its cache holds
# 2 key/value heads of 4), also with Llama 3.1's rescaled rotary frequencies.
LLAMA = LlamaConfig(name="test-llama", layers=2, hidden=32, heads=4, vocab=256, seq_len=64, kv_heads=2,
                    ffn_hidden=48)  # fmt: skip
LLAMA31 = RopeScaling(
    "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
)
MODELS = {
    "gpt": tiny_model(seq_len=64),
    "gpt2": Gpt2Config(**tiny_model(seq_len=64).to_dict(), tie_embeddings=False),  # two stages in checkpointed_run
    "llama": LLAMA,
    "llama3.1": replace(LLAMA, rope_scaling=LLAMA31),
}


@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize(
    "sampling", [Sampling(tokens=40, temperature=0), Sampling(tokens=40, temperature=1.5, top_k=5, seed=7)]
)
def test_cached_generation_equals_recomputing_the_sequence(sampling, arch):
    model = build_model(MODELS[arch], seed=3).eval()
    prompt = list(b"The cat")
    cached = generate(model, prompt, sampling, vocab=256)
    whole, _ = recomputed(model, prompt, sampling, 256)
    assert cached == whole and len(cached) == 40
    if sampling.temperature == 0:  # greedy: the random model does not just repeat one token
        assert len(set(cached)) > 3


@pytest.mark.parametrize("arch", MODELS)
def test_the_cache_gives_the_whole_sequences_logits(arch):
    """Token by token over the K/V cache, each step's logits equal the whole sequence's at that position."""
    model = build_model(MODELS[arch], seed=5).eval()

    tokens = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(0))
    caches = [KVCache(30) for _ in model.layer_ids]
    with torch.no_grad():
        whole = model(tokens)
        steps = [model(tokens[:, :10], 0, caches)] + [model(tokens[:, t : t + 1], t, caches) for t in range(10, 30)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-5, atol=1e-5)


def test_top_k_one_is_greedy_and_ids_beyond_the_tokenizer_are_never_drawn():
    model = GPT(tiny_model(seq_len=64, vocab=300), seed=2).eval()
    greedy = generate(model, [65, 66], Sampling(tokens=20, temperature=0), vocab=256)
    assert generate(model, [65, 66], Sampling(tokens=20, temperature=3.0, top_k=1, seed=4), vocab=256) == greedy
    hot = generate(model, [65, 66], Sampling(tokens=60, temperature=50.0, seed=1), vocab=256)
    assert max(hot) < 256 and len(set(hot)) > 20  # near-uniform over the 256 bytes, never 256..299


def test_byte_tokenizer():
    tok = run_tokenizer(None, 256)
    assert tok.encode("é!") == [0xC3, 0xA9, 33] and tok.decode([0xC3, 0xA9, 33]) == "é!"
    assert tok.decode([0xC3]) == "\ufffd"  # a character cut short decodes as the replacement character
    assert run_tokenizer("data/story.txt", 256).name == "UTF-8 bytes"
    with pytest.raises(ValueError, match="outside the model's vocabulary of 128"):
        run_tokenizer(None, 128).encode("é")


@pytest.mark.parametrize("arch", MODELS)
def test_sample_prints_the_greedy_continuation(tmp_path, capsys, arch):
    cfg = replace(MODELS[arch], seq_len=32)
    run = checkpointed_run(tmp_path / "run", cfg)
    threads = torch.get_num_threads()
    p = run_cli(capsys, "sample", str(run), "--prompt", "The cat", "--tokens", "20", "--temperature", "0")
    assert p.returncode == 0, p.stderr
    assert torch.get_num_threads() == threads  # --threads 1 while it ran, then as before (the demo runs in-process)
    model = build_model(cfg, seed=1).eval()
    expected = generate(model, list(b"The cat"), Sampling(tokens=20, temperature=0), vocab=256)
    assert p.stdout == bytes(list(b"The cat") + expected).decode("utf-8", errors="replace") + "\n"
    assert "step 3" in p.stderr and "UTF-8 bytes" in p.stderr


def test_sample_draws_depend_on_the_seed_only(tmp_path, capsys):
    run = checkpointed_run(tmp_path / "run")
    outs = [
        run_cli(capsys, "sample", str(run), "-p", "Ada", "-n", "24", "--temperature", "2", "--seed", str(s)).stdout
        for s in (1, 1, 2)
    ]
    assert outs[0] == outs[1] != outs[2] and outs[0].startswith("Ada")


@pytest.mark.parametrize(
    "args, words",
    [
        (["--tokens", "0"], ["--tokens", "at least 1"]),
        (["--temperature", "-1"], ["--temperature", "0 (greedy) or a finite positive number"]),
        (["--temperature", "inf"], ["--temperature", "finite", "got inf"]),
        (["--top-k", "0"], ["--top-k", "at least 1"]),
        (["--threads", "0"], ["--threads", "at least 1"]),
        (["--step", "2"], ["--step", "no complete checkpoint of step 2"]),
        (["--prompt", "\udcff"], ["--prompt", "not UTF-8"]),
        (["--prompt", ""], ["--prompt", "holds no token"]),
        (["--prompt", "ab", "--tokens", "40"], ["--tokens", "seq_len 32"]),
    ],
)
def test_sample_refuses_bad_arguments(tmp_path, capsys, args, words):
    run = checkpointed_run(tmp_path / "run")
    assert_one_line_error(run_cli(capsys, "sample", str(run), *args), *words)


def test_sample_refuses_a_run_without_a_checkpoint_or_a_prompt_outside_the_vocabulary(tmp_path, capsys):
    p = run_cli(capsys, "sample", str(make_run(tmp_path / "bare", [(1, [8, 8, 8, 8])])), "--prompt", "x")
    assert_one_line_error(p, "no complete checkpoint")
    assert_one_line_error(run_cli(capsys, "sample", str(tmp_path / "none")), "not a run folder")
    run = checkpointed_run(tmp_path / "small", tiny_model(seq_len=32, vocab=128))
    assert_one_line_error(run_cli(capsys, "sample", str(run), "--prompt", "café"), "--prompt", "'é'", "128")


def test_a_token_file_run_needs_tiktoken_and_the_gpt2_vocabulary(tmp_path, capsys, monkeypatch):
    small = checkpointed_run(tmp_path / "small", data="tokens.bin")
    assert_one_line_error(run_cli(capsys, "sample", str(small)), "tokens.bin", "GPT-2 BPE", "only 256")
    bpe = checkpointed_run(tmp_path / "bpe", tiny_model(hidden=8, layers=2, seq_len=32, vocab=50304), data="t.bin")
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # as in a Python without it
    assert_one_line_error(run_cli(capsys, "sample", str(bpe)), "tiktoken", "pip install tiktoken")
