"""The model families, one folder each, and their registry: one arch spec per ``arch`` a model config names. The
rest of terapipe asks its `Arch`, never ``if arch == ...`` (docs/design.md §6c). No torch here or in any arch spec:
the planner reads them too; a family's torch module is named by its arch spec (``Arch.module``) and imported when a
model is built.

spec.py       what every family's config has (`ModelConfig`) and what an arch spec says (`Arch`): its module, settings,
              parameter counts, tensor-parallel splits, analytic FLOP/byte description, `transformers` key table and
              configs; `vocab_rows`, the vocabulary's rows per tensor rank; `flops_per_token` (the MFU numerator)
attention.py  the K/V cache and the attention over a slice's context, shared by every family's module (torch)
init.py       the seeded per-component initialisation every family's module uses (torch)
decoder.py    the stage layout every family's module shares: a stage's layers, the ends, tied embeddings (torch)
gpt/          ``gpt``, the default: nanoGPT's decoder; ``gpt2``: GPT-2 exactly (biases, tanh GELU, tied embeddings)
llama/        ``llama``: the Llama family, Llama 3.1's RoPE scaling; Mistral's layer read as it

A family is a folder: ``spec.py`` (torch-free: its config, a `ModelConfig` subclass with its own settings, its arch
spec, an `Arch` subclass naming that config, and ``ARCHS``, the instances it registers) and ``module.py`` (its torch
module), and its name in `FAMILIES`.
"""

from __future__ import annotations

import importlib

from terapipe_cli.models.gpt.spec import Gpt2Config, GptConfig
from terapipe_cli.models.llama.spec import LlamaConfig, RopeScaling
from terapipe_cli.models.spec import (
    COMMON_FIELDS,
    Arch,
    ModelConfig,
    Split,
    backward_input_share,
    flops_per_token,
    vocab_rows,
    vocab_share,
)

# The families, one folder each: a line here registers every arch spec its ``spec.ARCHS`` holds.
FAMILIES = (
    "gpt",
    "llama",
)
ARCHS: dict[str, Arch] = {
    spec.name: spec
    for family in FAMILIES
    for spec in importlib.import_module(f"terapipe_cli.models.{family}.spec").ARCHS
}


def arch_spec(name: str) -> Arch:
    """The arch spec of architecture ``name`` (a `KeyError` naming the known ones otherwise)."""
    try:
        return ARCHS[name]
    except KeyError:
        raise KeyError(f"unknown arch {name!r} (known: {', '.join(ARCHS)})") from None


def transformers_arch(cls: str) -> Arch | None:
    """The arch spec that reads a `transformers` class's config (``LlamaForCausalLM``: llama), or None."""
    return next((spec for spec in ARCHS.values() if cls in spec.transformers_classes), None)


def all_splits() -> dict[str, Split]:
    """Every architecture's tensor-parallel splits in one table, by the end of a parameter's name: a name means the
    same parameter in every architecture that has it, so one lookup serves all (`engine.tensor.split_of`)."""
    out: dict[str, Split] = {}
    for spec in ARCHS.values():
        for suffix, split in spec.splits.items():
            if out.setdefault(suffix, split) != split:
                raise ValueError(f"arch {spec.name!r} cuts {suffix} otherwise than another architecture")
    return out


def build_model(cfg: ModelConfig, stage: int = 0, stages: int = 1, **kwargs):
    """The torch module of the architecture ``cfg.arch`` names (its arch spec's ``module``: `gpt.module.GPT`,
    `gpt.module.GPT2`, `llama.module.Llama`; same arguments, same stage layout). Imports torch."""
    return cfg.spec.model_class()(cfg, stage, stages, **kwargs)


__all__ = [
    "ARCHS",
    "COMMON_FIELDS",
    "FAMILIES",
    "Arch",
    "Gpt2Config",
    "GptConfig",
    "LlamaConfig",
    "ModelConfig",
    "RopeScaling",
    "Split",
    "all_splits",
    "arch_spec",
    "backward_input_share",
    "build_model",
    "flops_per_token",
    "transformers_arch",
    "vocab_rows",
    "vocab_share",
]
