"""The architecture registry: one spec per ``arch`` a model config names, and the rest of terapipe asks it, never
``if arch == ...`` (docs/design.md, "Architecture registry"). No torch: planning reads specs too.

base.py    what a spec says (`Arch`): its module, settings, parameter counts, tensor-parallel splits, analytic
           FLOP/byte description, `transformers` key table and configs; `flops_per_token` (the MFU numerator)
gpt.py     ``gpt``, the default: nanoGPT's decoder (engine/model.py)
gpt2.py    ``gpt2``: GPT-2 exactly (biases, tanh GELU, tied embeddings)
llama.py   ``llama``: the Llama family (engine/llama.py), Llama 3.1's RoPE scaling; Mistral's layer read as it

Adding an architecture: a spec module here (an `Arch` subclass), its torch module under engine/ named by the spec's
``module``, and one line in `ARCHS`.
"""

from __future__ import annotations

from terapipe_cli.arch.base import COMMON_FIELDS, Arch, Split, backward_input_share, flops_per_token
from terapipe_cli.arch.gpt import GptArch
from terapipe_cli.arch.gpt2 import Gpt2Arch
from terapipe_cli.arch.llama import LlamaArch, RopeScaling

ARCHS: dict[str, Arch] = {spec.name: spec for spec in (GptArch(), Gpt2Arch(), LlamaArch())}


def arch_spec(name: str) -> Arch:
    """The spec of architecture ``name`` (a `KeyError` naming the known ones otherwise)."""
    try:
        return ARCHS[name]
    except KeyError:
        raise KeyError(f"unknown arch {name!r} (known: {', '.join(ARCHS)})") from None


def transformers_arch(cls: str) -> Arch | None:
    """The spec that reads a `transformers` class's config (``LlamaForCausalLM``: llama), or None."""
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


__all__ = [
    "ARCHS",
    "COMMON_FIELDS",
    "Arch",
    "RopeScaling",
    "Split",
    "all_splits",
    "arch_spec",
    "backward_input_share",
    "flops_per_token",
    "transformers_arch",
]
