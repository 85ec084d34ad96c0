"""``terapipe export --format hf``: a run's model as a Hugging Face ``transformers`` folder.

    OUT/config.json          the model's `transformers` config (its arch spec's `hf_config`), by ``save_pretrained``
    OUT/model.safetensors    its weights under `transformers`' names, fp32 (metadata: terapipe's step and run)
    OUT/tokenizer.json       a corpus run's own tokenizer (`train.tokenizer`), with tokenizer_config.json naming
                             its BOS and EOS, which config.json's bos/eos_token_id give as ids; none for a byte run

``AutoModelForCausalLM.from_pretrained(OUT)`` loads it — a ``LlamaForCausalLM`` for ``arch = "llama"``, a
``GPT2LMHeadModel`` for ``arch = "gpt"`` and ``"gpt2"`` — with no missing or unexpected keys, and its logits equal
the single-device model's (tests/train/test_hf_export.py). The names are one table per architecture, its arch spec's
``hf_keys`` (`terapipe_cli.models`; ``{n}``: a layer's global index), also in docs/design.md (§6c):

- llama: the same tensors under `transformers`' names. No permutation: terapipe's RoPE is the rotate-half
  convention of `transformers`' Llama (`models.llama.module`); Llama 3.1's ``rope_scaling`` is written as it is.
- gpt2: GPT-2 itself; a tied head (``tie_embeddings``, GPT-2's default) is written once, as the embedding
  (``tie_word_embeddings = true``), as a tied llama head is.
- gpt: GPT-2's computation with three differences the folder absorbs exactly: no biases in terapipe's linear
  layers (GPT-2 has them: written as zeros, the arch spec's `hf_zero_tensors`), the exact erf GELU
  (``activation_function = "gelu"``, not GPT-2's tanh approximation ``gelu_new``), and an LM head of its own
  (``tie_word_embeddings = false``). GPT-2's ``Conv1D`` stores a linear layer's weight as (in, out): transposed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import torch

from terapipe_cli.errors import UserError
from terapipe_cli.extras import require
from terapipe_cli.models import ModelConfig
from terapipe_cli.train.rundir import read_config
from terapipe_cli.train.tokenizer import RunTokenizer, run_tokenizer_files, write_hf_tokenizer

WHERE = "--format hf"


def require_hf() -> None:
    """Both packages the folder needs, checked before anything is read or written."""
    require("transformers", where=WHERE)
    require("safetensors", where=WHERE)


def _names(pattern: str, layers: int) -> list[tuple[int | None, str]]:
    return [(n, pattern.format(n=n)) for n in range(layers)] if "{n}" in pattern else [(None, pattern)]


def hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the single-device model's) under `transformers`' names, fp32, each tensor its own storage."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for ours, theirs, transposed in cfg.spec.hf_keys:
        for n, name in _names(ours, cfg.layers):
            used.add(name)
            if cfg.tie_embeddings and name == "lm_head.weight":
                continue
            t = state[name].detach().float()
            out[theirs.format(n=n)] = (t.t() if transposed else t).contiguous().clone()
    if used != set(state):
        raise ValueError(f"weights the {cfg.arch} table does not name: {sorted(set(state) - used)[:3]}")
    for name, length in cfg.spec.hf_zero_tensors(cfg).items():
        out[name] = torch.zeros(length)
    return out


def hf_config(cfg: ModelConfig):
    """The `transformers` config of ``cfg``: its architecture's (`terapipe_cli.models`' ``hf_config``)."""
    require("transformers", where=WHERE)
    return cfg.spec.hf_config(cfg)


def check_output_folder(out: Path) -> None:
    """``--out`` must be a new folder (or an empty one) in a writable folder that exists or, as for the .pt export
    (`files.check_output_file`), is made itself: one line otherwise, before anything is read."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file; --format hf writes a folder (config.json, model.safetensors)", where="--out")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"folder {out} is not empty; give a new or an empty folder", where="--out")
    parent = out.resolve().parent
    if parent.exists() and not parent.is_dir():
        raise UserError(f"{parent} is a file, not a folder", where="--out")
    if not parent.exists() and not parent.parent.is_dir():
        raise UserError(f"folder {parent.parent} does not exist (only {parent.name}/ would be created)", where="--out")
    nearest = parent if parent.exists() else parent.parent
    if not os.access(nearest, os.W_OK):
        raise UserError(f"cannot write into folder {nearest}", where="--out")


def run_tokenizer_of(run: Path) -> RunTokenizer | None:
    """The tokenizer files of the run folder ``run`` (`train.tokenizer`): its own copy, or its corpus's."""
    return run_tokenizer_files(run, read_config(run)[0]["arguments"].get("data"))


def write_hf(
    out: Path,
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    *,
    step: int,
    run: Path,
    tokenizer: RunTokenizer | None = None,
) -> None:
    """Write the folder: into a hidden temporary folder beside ``out``, renamed to ``out`` once whole, so a
    failure at any point leaves nothing behind (the temporary folder is removed). ``tokenizer``: the run's, whose
    files and special ids go into the folder too (`run_tokenizer_of`)."""
    require_hf()
    safetensors_torch = require("safetensors.torch", where=WHERE)
    config, tensors = hf_config(cfg), hf_state(cfg, state)
    if tokenizer is not None:  # the run's own special ids, not the architecture's defaults
        config.bos_token_id, config.eos_token_id = tokenizer.bos_id, tokenizer.eos_id
    out = out.resolve()
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    made = not out.parent.exists()  # its folder, made here (`check_output_folder`), goes again on a failure
    try:
        out.parent.mkdir(exist_ok=True)
        tmp.mkdir()
        config.save_pretrained(tmp)
        if tokenizer is not None:
            write_hf_tokenizer(tmp, tokenizer, seq_len=cfg.seq_len)
        metadata = {"format": "pt", "terapipe_step": str(step), "terapipe_run": str(run.resolve())}
        safetensors_torch.save_file(tensors, tmp / "model.safetensors", metadata=metadata)
        if out.is_dir():
            out.rmdir()  # empty (checked); a folder that filled since makes this fail, and tmp goes
        tmp.rename(out)
    except OSError as e:  # a full disk, a folder made meanwhile: one line, nothing left behind
        _remove(tmp, out.parent if made else None)
        raise UserError(f"cannot write {out} ({e.strerror or e}); nothing was written", where="--out") from None
    except BaseException:
        _remove(tmp, out.parent if made else None)
        raise


def _remove(tmp: Path, made: Path | None) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    if made is not None:
        with contextlib.suppress(OSError):
            made.rmdir()  # only if still empty
