"""``terapipe sample``: text from a run's checkpoint, generated on one device with a K/V cache.

The model is the run's single-device model (`train.export.export_state`: the stages joined). Generation uses the
same `KVCache` the pipeline's token slices use: the prompt is one slice at position 0, then every new token is a
slice of one token at its absolute position, attending over the cached keys/values of all earlier ones — so a step
costs one token's forward, and the logits equal a forward of the whole sequence (tested).

The tokenizer is the run's own: a run on a corpus from ``terapipe data tokenize`` recorded the corpus's tokenizer in
its folder (``RUN/tokenizer/``, `train.tokenizer`; a run from before that reads the one beside its corpus,
``CORPUS.tokenizer/``), read with the ``tokenizers`` package, no tiktoken; a prompt starts with the template's tokens,
as every document did; a text file (or the embedded default) is read as bytes, so its tokenizer is UTF-8 bytes
(ids 0..255); any other token file (`corpus.formats.names_token_ids`) is taken to hold GPT-2 BPE ids (tiktoken's
``gpt2`` encoding, as nanoGPT's preparation writes them; 50257 ids), which needs the ``tiktoken`` package. Ids the
model has beyond the tokenizer's (a padded vocabulary) are never sampled.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from terapipe_cli.corpus.formats import names_token_ids
from terapipe_cli.errors import UserError
from terapipe_cli.extras import require
from terapipe_cli.models.attention import KVCache
from terapipe_cli.train.export import run_model
from terapipe_cli.train.rundir import read_config
from terapipe_cli.train.tokenizer import RunTokenizer, run_tokenizer_files

GPT2_VOCAB = 50257  # tiktoken's "gpt2" encoding: 50000 merges + 256 bytes + <|endoftext|>


@dataclass(frozen=True)
class Tokenizer:
    name: str
    vocab: int  # ids 0 .. vocab - 1 decode to text
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    default_prompt: list[int]  # what a sample starts from without --prompt


def run_tokenizer(data: str | None, model_vocab: int, run_dir: Path | None = None) -> Tokenizer:
    """The tokenizer of a run (in ``run_dir``) whose data file is ``data`` (None: the embedded text) and whose model
    has ``model_vocab`` ids; one-line `UserError` when this model cannot be decoded with it."""
    files = run_tokenizer_files(run_dir, data)
    if files is not None:
        return _corpus_tokenizer(files, model_vocab)
    if data is None or not names_token_ids(data):
        vocab = min(256, model_vocab)
        return Tokenizer(
            "UTF-8 bytes",
            vocab,
            lambda text: _encode_bytes(text, vocab),
            lambda ids: bytes(ids).decode("utf-8", errors="replace"),
            default_prompt=[ord("\n")] if vocab > ord("\n") else [0],  # a text's line break: a story starts after it
        )
    if model_vocab < GPT2_VOCAB:
        raise UserError(
            f"the run's data is a token file, read as GPT-2 BPE ids ({GPT2_VOCAB}), but the model has only "
            f"{model_vocab}: this run's tokenizer is not known",
            where=data,
        )
    tiktoken = require("tiktoken", where="the GPT-2 BPE of a token-file run")
    try:
        encoding = tiktoken.get_encoding("gpt2")
    except Exception as e:  # tiktoken fetches its BPE files on first use and caches them (TIKTOKEN_CACHE_DIR)
        raise UserError(
            f"tiktoken cannot load the 'gpt2' encoding ({type(e).__name__}: {e})", where="tiktoken"
        ) from None
    return Tokenizer(
        "GPT-2 BPE (tiktoken)",
        GPT2_VOCAB,
        lambda text: encoding.encode(text, allowed_special={"<|endoftext|>"}),
        encoding.decode,
        default_prompt=[encoding.eot_token],
    )


def _corpus_tokenizer(files: RunTokenizer, model_vocab: int) -> Tokenizer:
    """The corpus's own tokenizer; a sample without --prompt starts as a document does (its template's tokens, or
    after the EOS of the one before)."""
    path = files.file
    tokenizers = require("tokenizers", where=f"the tokenizer of the run's corpus ({path.parent})")
    tok = tokenizers.Tokenizer.from_file(str(path))
    tok.encode_special_tokens = True  # as when the corpus was made: special tokens written in a prompt are text
    vocab = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    if vocab > model_vocab:
        raise UserError(
            f"the run's corpus tokenizer has {vocab} ids but the model only {model_vocab}", where=str(path.parent)
        )
    start = tok.encode("", add_special_tokens=True).ids or [files.eos_id if files.eos_id is not None else 0]
    return Tokenizer(
        f"{path.parent.name}/ ({vocab:,} ids)",
        vocab,
        lambda text: tok.encode(text, add_special_tokens=True).ids,
        lambda ids: tok.decode(ids, skip_special_tokens=False),
        default_prompt=start,
    )


def _encode_bytes(text: str, vocab: int) -> list[int]:
    try:
        ids = list(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise UserError(
            f"character {text[e.start]!r} at {e.start} is not UTF-8 text, which the run's byte tokenizer reads",
            where="--prompt",
        ) from None
    outside = next((n for n, t in enumerate(ids) if t >= vocab), None)
    if outside is not None:
        char = text.encode("utf-8")[outside:].decode("utf-8", errors="replace")[:1]
        raise UserError(
            f"{char!r} is byte {ids[outside]}, outside the model's vocabulary of {vocab} bytes", where="--prompt"
        )
    return ids


@dataclass(frozen=True)
class Sampling:
    tokens: int  # new tokens to generate
    temperature: float = 1.0  # 0: greedy (the most likely token)
    top_k: int | None = None  # sample among the k most likely (None: all)
    seed: int = 0

    def check(self) -> None:
        if self.tokens < 1:
            raise UserError(f"must be at least 1, got {self.tokens}", where="--tokens")
        if not 0 <= self.temperature < math.inf:  # also refuses nan; inf would divide every logit to 0 or nan
            raise UserError(
                f"must be 0 (greedy) or a finite positive number, got {self.temperature}", where="--temperature"
            )
        if self.top_k is not None and self.top_k < 1:
            raise UserError(f"must be at least 1 (or left out: all tokens), got {self.top_k}", where="--top-k")


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: list[int], sampling: Sampling, *, vocab: int) -> list[int]:
    """``sampling.tokens`` new ids after ``prompt`` from ``model`` (a single-device model, eval mode), drawn only
    among ids < ``vocab``: one forward of the prompt, then one token at a time at its absolute position over the
    K/V cache of every earlier one."""
    sampling.check()
    if not prompt:
        raise UserError("holds no token: give at least one character", where="--prompt")
    device = next(model.parameters()).device
    total = len(prompt) + sampling.tokens
    if total - 1 > model.cfg.seq_len:
        raise UserError(
            f"{len(prompt)} prompt tokens + {sampling.tokens} new ones exceed the model's seq_len "
            f"{model.cfg.seq_len} (+1: the last token is not fed back)",
            where="--tokens",
        )
    caches = [KVCache(total - 1) for _ in model.layer_ids]
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    x = torch.tensor([prompt], device=device)
    start, out = 0, []
    while True:
        logits = model(x, start, caches)[0, -1, :vocab].float()
        out.append(pick(logits, sampling, generator))
        if len(out) == sampling.tokens:
            return out
        start += x.shape[1]
        x = torch.tensor([[out[-1]]], device=device)


def pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """One id from the next-token ``logits`` (vocab,): the argmax at temperature 0, else drawn from
    softmax(logits / temperature) over the ``top_k`` largest."""
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.numel():
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass(frozen=True)
class Sample:
    text: str  # the prompt and its continuation, decoded
    step: int  # the checkpoint's
    model: str  # the model's name
    tokenizer: str
    tokens: int  # new tokens
    seconds: float  # the generation's wall time (the prompt's forward included, loading not)


def sample_run(
    run_dir: Path, prompt: str | None, sampling: Sampling, *, step: int | None, device: str, threads: int
) -> Sample:
    """Generate from the run's checkpoint of ``step`` (default: the latest) with the run's tokenizer; ``prompt``
    None: the tokenizer's default. ``threads``: torch's CPU threads while it runs (restored after)."""
    sampling.check()
    previous = torch.get_num_threads()
    # One token's forward is small: on a busy 2-core machine, 2 threads made a tiny model's tokens 10x slower.
    torch.set_num_threads(threads)
    try:
        model, done = run_model(run_dir, step)
        config, _ = read_config(run_dir)
        tokenizer = run_tokenizer(config["arguments"].get("data"), model.cfg.vocab, run_dir)
        ids = tokenizer.default_prompt if prompt is None else tokenizer.encode(prompt)
        started = time.perf_counter()
        new = generate(model.to(device), ids, sampling, vocab=tokenizer.vocab)
        seconds = time.perf_counter() - started
    finally:
        torch.set_num_threads(previous)
    return Sample(tokenizer.decode(ids + new), done, model.cfg.name, tokenizer.name, len(new), seconds)
