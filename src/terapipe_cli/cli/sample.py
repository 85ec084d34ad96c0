"""``terapipe sample``: text from a run's checkpoint (train/sample.py), on one device with a K/V cache."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from terapipe_cli.engine import require_torch
from terapipe_cli.errors import UserError

HELP = """Generate text from a run's checkpoint on one device: the run's stages joined into the single-device model, \
the prompt read with the run's own tokenizer (a corpus's from terapipe data tokenize, copied beside it; UTF-8 bytes \
for a text data file or the embedded default; GPT-2 BPE for another token file, which needs pip install tiktoken), \
then one token at a time over a K/V cache.

Prints the prompt and its continuation on stdout (the run, step and speed on stderr). --temperature 0 is greedy.

Examples:

    terapipe sample runs/demo/TIMESTAMP/run --prompt "The cat" --tokens 60

    terapipe sample run --prompt "Ada sees" --temperature 0

    terapipe sample run --step 20 --tokens 200 --temperature 1.0 --top-k 10 --seed 3
"""

# nanoGPT's sample.py defaults for temperature and top-k; 100 new tokens: a few lines of text.
DEFAULT_TOKENS, DEFAULT_TEMPERATURE, DEFAULT_TOP_K = 100, 0.8, 200


def sample(
    run: Annotated[Path, typer.Argument(help="The run folder (`terapipe train --out`).", show_default=False)],
    prompt: Annotated[
        str | None,
        typer.Option("--prompt", "-p", help="Text to continue (default: a line break, or GPT-2's <|endoftext|>)."),
    ] = None,
    tokens: Annotated[int, typer.Option("--tokens", "-n", help="New tokens to generate.")] = DEFAULT_TOKENS,
    temperature: Annotated[
        float, typer.Option("--temperature", "-t", help="Softmax temperature; 0: greedy (the most likely token).")
    ] = DEFAULT_TEMPERATURE,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample among the k most likely tokens.")] = DEFAULT_TOP_K,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the draws.")] = 0,
    step: Annotated[
        int | None, typer.Option("--step", help="A complete checkpoint's step (default: the latest).")
    ] = None,
    device: Annotated[str, typer.Option("--device", help="cpu, cuda or auto (one device).")] = "cpu",
    threads: Annotated[
        int, typer.Option("--threads", help="CPU threads (1, as train's workers: one token's forward is small).")
    ] = 1,
) -> None:
    require_torch("terapipe sample")
    from terapipe_cli.config.device import resolve_device
    from terapipe_cli.train import sample as sampling  # PyTorch: loaded when the command runs

    settings = sampling.Sampling(tokens=tokens, temperature=temperature, top_k=top_k, seed=seed)
    settings.check()  # bad arguments before the checkpoint is read
    if threads < 1:
        raise UserError(f"must be at least 1, got {threads}", where="--threads")
    done = sampling.sample_run(run, prompt, settings, step=step, device=resolve_device(device), threads=threads)
    sys.stderr.write(
        f"{run}: step {done.step}, model {done.model}, {done.tokenizer}; {done.tokens} tokens in {done.seconds:.2f} s "
        f"({done.tokens / done.seconds:.0f} tokens/s)\n"
    )
    print(done.text)


def register(app: typer.Typer) -> None:
    app.command("sample", help=HELP)(sample)
