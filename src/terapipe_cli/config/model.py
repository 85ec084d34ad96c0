"""Model configurations: TOML files under ``configs/models/`` (or `transformers` folders) loaded into a validated
`terapipe_cli.models.ModelConfig`.

[model]
name = "tiny"
layers = 4        # decoder layers N
hidden = 256      # H
heads = 4
vocab = 256
seq_len = 1024    # L

``arch`` names the architecture, a family of the registry (`terapipe_cli.models`), whose config class says what
else the table takes (`GptConfig`, `Gpt2Config`, `LlamaConfig`). arch = "gpt" (the default) is a GPT-2-style
decoder: LayerNorm, learned positions, a GELU MLP of mlp_ratio·H, no biases. arch = "gpt2" is GPT-2 exactly: biases,
the tanh GELU, and (default) tie_embeddings = true; it takes mlp_ratio, norm_eps (LayerNorm's, default 1e-5) and
tie_embeddings. arch = "llama" is a Llama-family decoder (RMSNorm, rotary positions, a SwiGLU MLP of ffn_hidden,
grouped-query attention):

arch = "llama"
kv_heads = 2          # key/value heads, dividing heads (default: heads)
ffn_hidden = 768      # the SwiGLU width
rope_theta = 10000.0  # the rotary base (default 10000, RoFormer's)
norm_eps = 1e-5       # RMSNorm's epsilon (default 1e-5)
tie_embeddings = false
rope_scaling = {rope_type = "llama3", factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0,
                original_max_position_embeddings = 8192}  # Llama 3.1's; optional

A model may also be a `transformers` folder (or its config.json): `load_model_config` reads it through the arch spec
whose ``transformers_classes`` name its architecture (`model_from_transformers`).
"""

from __future__ import annotations

from pathlib import Path

from terapipe_cli.config.bundled import find_config, load_toml
from terapipe_cli.errors import UserError
from terapipe_cli.files import Fields, read_json
from terapipe_cli.models import ARCHS, ModelConfig, transformers_arch


def load_model_config(path: str | Path) -> ModelConfig:
    """Load ``[model]`` from a TOML file, a bundled model by name (``tiny``, ``gpt3-13b``; `find_config`), or a
    `transformers` folder or its ``config.json`` (`model_from_transformers`). A TOML's ``[model]`` may itself name
    such a folder: ``transformers = "DIR"`` (relative to the TOML), with ``name`` and ``seq_len`` optional."""
    path = find_config(path, "models", "--model")
    if path.is_dir() or path.suffix == ".json":
        return model_from_transformers(path)
    data = load_toml(path, "model config")
    table = data.get("model")
    if not isinstance(table, dict):
        raise UserError("missing the [model] table", where=str(path))
    if "transformers" in table:
        f = Fields(table, str(path), "model.")
        unknown = sorted(set(table) - {"transformers", "name", "seq_len"})
        if unknown:
            raise f.fail(unknown[0], "is not a setting of a transformers model (known: name, seq_len, transformers)")
        folder = Path(f.str("transformers")).expanduser()
        return model_from_transformers(
            folder if folder.is_absolute() else path.resolve().parent / folder,
            seq_len=f.int("seq_len", minimum=1) if "seq_len" in table else None,
            name=f.str("name") if "name" in table else None,
        )
    return ModelConfig.from_dict(table, str(path))


def model_from_transformers(path: str | Path, *, seq_len: int | None = None, name: str | None = None) -> ModelConfig:
    """The model of a `transformers` folder (``save_pretrained``'s) or of its ``config.json``: its architecture
    (``architectures``) read by the arch spec that names it (`terapipe_cli.models.transformers_arch`: LlamaForCausalLM,
    MistralForCausalLM, GPT2LMHeadModel); any other, or a setting its arch spec cannot compute exactly, is refused in
    one line naming it. ``seq_len``: the longest the model takes (max_position_embeddings, n_positions) unless given;
    ``name``: the folder's."""
    path = Path(path)
    config = path / "config.json" if path.is_dir() else path
    if path.is_dir() and not config.is_file():
        raise UserError(
            "is a folder without a config.json (give a model TOML or a transformers folder)", where=str(path)
        )
    obj = read_json(config, what="transformers config.json")
    f = Fields(obj, str(config))
    classes = obj.get("architectures")
    if not (isinstance(classes, list) and classes and all(isinstance(c, str) for c in classes)):
        raise f.fail("architectures", f"must name the model's class (a model's save_pretrained does), got {classes!r}")
    spec = transformers_arch(classes[0])
    if spec is None:
        readable = [c for s in ARCHS.values() for c in s.transformers_classes]
        message = f"names {classes[0]}, not an architecture terapipe computes ({', '.join(readable)})"
        raise f.fail("architectures", message)
    spec = spec.reads_transformers_as(f)
    fields = spec.from_transformers(f, seq_len)
    cfg = spec.config(name=name or config.resolve().parent.name, **fields)
    cfg.check(f)
    return cfg
