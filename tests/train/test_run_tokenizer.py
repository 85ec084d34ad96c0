"""The run's own tokenizer everywhere: a run on a ``terapipe data tokenize``d corpus records the
corpus's tokenizer in its folder; ``terapipe sample`` decodes with that copy (the corpus may have moved; no tiktoken);
``terapipe export --format hf`` writes the tokenizer files and the run's BOS/EOS ids, so that ``transformers`` loads
the tokenizer and the model from the folder together and a prompt round-trips."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import run_cli
from fake_runs import checkpointed_run

from terapipe_cli.engine.data import generate_default_text
from terapipe_cli.models import LlamaConfig
from terapipe_cli.train.tokenizer import RUN_TOKENIZER, record_tokenizer, run_tokenizer_files

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

EOT, BOS = "<|endoftext|>", "<|begin_of_text|>"
TEXT = generate_default_text(30_000, seed=5)


@pytest.fixture(scope="module")
def llama_tokenizer(tmp_path_factory):
    """A byte-level BPE of 500 ids whose template starts every text with <|begin_of_text|> (as Llama 3's), in a
    folder whose tokenizer_config.json names its EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=[EOT, BOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXT.splitlines(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    folder = tmp_path_factory.mktemp("llama-tokenizer")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": EOT}, "bos_token": BOS}))
    return folder


def test_sample_and_the_hf_export_use_the_runs_tokenizer(tmp_path, capsys, llama_tokenizer):
    (tmp_path / "stories.txt").write_text(TEXT)
    corpus = tmp_path / "data" / "corpus"
    p = run_cli(
        capsys, "data", "tokenize", tmp_path / "stories.txt", "--split", "line", "--tokenizer", llama_tokenizer,
        "--out", corpus,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    cfg = LlamaConfig(name="tok-llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=48,
                      vocab=512, seq_len=32)  # fmt: skip
    run = checkpointed_run(tmp_path / "run", cfg, data=str(corpus))
    record_tokenizer(run, str(corpus))  # what writing the run folder does (rundir.write_config)
    shutil.rmtree(tmp_path / "data")  # the corpus moved away: the run keeps its own copy
    files = run_tokenizer_files(run, str(corpus))
    assert files.folder == run / RUN_TOKENIZER and (files.eos_id, files.bos_id) == (0, 1)

    # sample: the prompt is encoded and the continuation decoded with the run's tokenizer.
    p = run_cli(capsys, "sample", str(run), "--prompt", "the cat sees", "--tokens", "5", "--temperature", "0")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"{BOS}the cat sees") and "tokenizer" in p.stderr

    # export --format hf: the tokenizer files and the run's special ids.
    out = tmp_path / "hf"
    p = run_cli(capsys, "export", str(run), "--format", "hf", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert {"tokenizer.json", "tokenizer_config.json"} <= {f.name for f in out.iterdir()}
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert (model.config.bos_token_id, model.config.eos_token_id) == (1, 0)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 0)
    prompt = "the small fox ran to the park."
    ids = tokenizer(prompt)["input_ids"]
    ours = tokenizers.Tokenizer.from_file(str(run / RUN_TOKENIZER / "tokenizer.json")).encode(prompt).ids
    assert ids == ours and ids[0] == 1  # the template's <|begin_of_text|>, as every document of the corpus
    assert tokenizer.decode(ids, skip_special_tokens=True) == prompt
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg.vocab)
