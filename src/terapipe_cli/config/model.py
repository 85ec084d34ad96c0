"""Model configurations: TOML files under ``configs/models/`` loaded into a validated dataclass.

[model]
name = "tiny"
layers = 4        # decoder layers N
hidden = 256      # H
heads = 4
vocab = 256
seq_len = 1024    # L

arch = "gpt" (the default) is a GPT-2-style decoder: LayerNorm, learned positions, a GELU MLP of mlp_ratio·H. arch =
"llama" is a Llama-family decoder (RMSNorm, rotary positions, a SwiGLU MLP of ffn_hidden, grouped-query attention):

arch = "llama"
kv_heads = 2          # key/value heads, dividing heads (default: heads)
ffn_hidden = 768      # the SwiGLU width
rope_theta = 10000.0  # the rotary base (default 10000, RoFormer's)
norm_eps = 1e-5       # RMSNorm's epsilon (default 1e-5)
tie_embeddings = false
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from terapipe_cli.config.bundled import find_config, load_toml
from terapipe_cli.errors import UserError
from terapipe_cli.files import Fields


@dataclass(frozen=True)
class ModelConfig:
    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    mlp_ratio: int = 4
    arch: str = "gpt"
    kv_heads: int | None = None  # None: heads (multi-head attention)
    ffn_hidden: int | None = None  # the MLP's inner width; None: mlp_ratio · hidden
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", self.mlp_ratio * self.hidden)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def llama(self) -> bool:
        return self.arch == "llama"

    @property
    def kv_width(self) -> int:
        """Features of one token's keys (and of its values): kv_heads · head_dim; H with one K/V head per query head.
        The K/V cache of a grouped-query model is kv_heads / heads of the multi-head one's."""
        return self.kv_heads * self.head_dim

    def end_params(self, vocab_rows: int) -> tuple[int, int]:
        """Parameters of the embedding (chunk 0) and of the head (the last chunk, its final norm with it) holding
        ``vocab_rows`` rows of the vocabulary: GPT's position table and LayerNorm bias, llama's RMSNorm weight."""
        H = self.hidden
        if self.llama:  # tied: the head's matrix is the embedding's, trained once
            return vocab_rows * H, (0 if self.tie_embeddings else vocab_rows * H) + H
        return vocab_rows * H + self.seq_len * H, vocab_rows * H + 2 * H

    def params_per_layer(self, tensor_parallel: int = 1, *, bias: bool = True) -> int:
        """Parameters of one decoder layer held by one device, with ``tensor_parallel`` ranks sharing the layer.

        Sharded: the Q/K/V and output projections and both MLP matrices (with their biases when ``bias``, as
        in GPT-3; the runtime's own model has none, as in nanoGPT). Replicated: the two layer norms (weight and
        bias) and the biases of the two row-parallel outputs. A llama layer has no biases (``bias`` is ignored):
        K and V have kv_heads · head_dim rows each, the SwiGLU MLP three H × ffn_hidden matrices.
        """
        H, t, inner = self.hidden, tensor_parallel, self.ffn_hidden
        if self.llama:  # q and o of H·H, k and v of kv_heads·head_dim rows, SwiGLU's three matrices; two RMSNorms
            return (2 * H * H + 2 * H * self.kv_width + 3 * H * inner) // t + 2 * H
        sharded = 3 * H * H + H * H + H * inner + inner * H
        replicated = 4 * H
        if bias:
            sharded += 3 * H + inner
            replicated += 2 * H
        return sharded // t + replicated

    def check_tensor_parallel(self, tensor_parallel: int, where: str = "tensor_parallel") -> None:
        """T ranks split the heads and the MLP's inner dimension (docs/design.md §6b): T must divide both."""
        t = tensor_parallel
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise UserError(f"must be a positive integer, got {t!r}", where=where)
        if self.heads % t:
            raise UserError(f"{t} does not divide the {self.heads} heads of model '{self.name}'", where=where)
        if self.kv_heads % t:  # each rank keeps whole key/value heads, those its own query heads read
            raise UserError(f"{t} does not divide the {self.kv_heads} kv_heads of model '{self.name}'", where=where)
        if self.llama and self.tie_embeddings and t > 1:
            raise UserError(
                f"model '{self.name}' ties its embeddings: tensor parallelism needs tie_embeddings = false", where=where
            )
        inner = self.ffn_hidden
        if inner % t:
            raise UserError(f"{t} does not divide the MLP's {inner} inner features of model '{self.name}'", where=where)

    def to_dict(self) -> dict:
        """The fields a TOML or JSON file gives: a GPT model's as before the llama fields existed (its plans and
        profiles are unchanged); a llama model's all but mlp_ratio."""
        out = asdict(self)
        for key in ("arch", *_LLAMA_FIELDS) if not self.llama else ("mlp_ratio",):
            out.pop(key)
        return out

    @classmethod
    def from_dict(cls, obj: dict, where: str, prefix: str = "model.") -> ModelConfig:
        """Build and validate from a mapping (a TOML table or a JSON object); errors name ``where``."""
        f = Fields(obj, where, prefix)
        cfg = cls(
            name=f.str("name"),
            layers=f.int("layers", minimum=1),
            hidden=f.int("hidden", minimum=1),
            heads=f.int("heads", minimum=1),
            vocab=f.int("vocab", minimum=2),
            seq_len=f.int("seq_len", minimum=1),
            mlp_ratio=f.int("mlp_ratio", minimum=1, default=4),
            **_llama_fields(f),
        )
        if cfg.hidden % cfg.heads:
            raise f.fail("heads", f"must divide hidden ({cfg.hidden}), got {cfg.heads}")
        if cfg.heads % cfg.kv_heads:
            raise f.fail("kv_heads", f"must divide heads ({cfg.heads}), got {cfg.kv_heads}")
        if cfg.llama and cfg.head_dim % 2:
            raise f.fail("heads", f"must leave an even head_dim for the rotary positions, got {cfg.head_dim}")
        known = {"name", "layers", "hidden", "heads", "vocab", "seq_len", "arch"}
        known |= set(_LLAMA_FIELDS) if cfg.llama else {"mlp_ratio"}
        unknown = sorted(set(obj) - known)
        if unknown:
            raise f.fail(unknown[0], f"is not a setting of arch = {cfg.arch!r} (known: {', '.join(sorted(known))})")
        return cfg

    def stage_layers(self, stages: int, where: str = "stages") -> int:
        """Layers per stage; the layer count must divide evenly (docs/design.md §6)."""
        if stages < 1:
            raise UserError(f"must be at least 1, got {stages}", where=where)
        if self.layers % stages:
            raise UserError(
                f"{stages} stages do not divide the {self.layers} layers of model '{self.name}' "
                f"(stage counts that divide them: {', '.join(map(str, self.stage_counts()))})",
                where=where,
            )
        return self.layers // stages

    def check_stages(self, stages: int, where: str = "stages") -> None:
        """A pipeline of ``stages`` stages needs at least one layer per stage: 1 ≤ K ≤ N (the layers need not divide
        evenly: a plan may give stages different counts, docs/design.md §11)."""
        if stages < 1:
            raise UserError(f"must be at least 1, got {stages}", where=where)
        if stages > self.layers:
            raise UserError(
                f"{stages} stages are more than the {self.layers} layers of model '{self.name}'", where=where
            )
        self.check_tied(stages, where)

    def check_tied(self, stages: int, where: str = "stages") -> None:
        """Tied embeddings need the embedding and the head on one device: one stage (and T = 1)."""
        if self.llama and self.tie_embeddings and stages > 1:
            raise UserError(
                f"model '{self.name}' ties its embeddings: its embedding and head share one tensor, which a pipeline "
                f"of {stages} stages would split (tie_embeddings = false to pipeline it)",
                where=where,
            )

    def stage_counts(self) -> list[int]:
        """The stage counts K that divide the layers evenly, ascending (1, 2, 4, 5, 8, 10, 20, 40 for 40 layers)."""
        small = [k for k in range(1, int(self.layers**0.5) + 1) if self.layers % k == 0]
        return sorted({*small, *(self.layers // k for k in small)})


ARCHS = ("gpt", "llama")
_LLAMA_FIELDS = ("kv_heads", "ffn_hidden", "rope_theta", "norm_eps", "tie_embeddings")


def _llama_fields(f: Fields) -> dict:
    """``arch`` and, for a llama model, its fields (ffn_hidden required; the rest with defaults)."""
    arch = f.str("arch", default="gpt")
    if arch not in ARCHS:
        raise f.fail("arch", f"must be one of {', '.join(ARCHS)}, got {arch!r}")
    if arch != "llama":
        return {"arch": arch}
    tie = f.get("tie_embeddings", False)
    if not isinstance(tie, bool):
        raise f.fail("tie_embeddings", f"must be true or false, got {tie!r}")
    return {
        "arch": arch,
        "kv_heads": f.int("kv_heads", minimum=1, default=f.int("heads", minimum=1)),
        "ffn_hidden": f.int("ffn_hidden", minimum=1),
        "rope_theta": f.number("rope_theta", positive=True, default=10000.0),
        "norm_eps": f.number("norm_eps", positive=True, default=1e-5),
        "tie_embeddings": tie,
    }


def vocab_rows(vocab: int, tensor_parallel: int, rank: int) -> range:
    """The rows of the token embedding and of the LM head that tensor rank ``rank`` of T holds under Megatron's
    vocabulary split (docs/design.md §6b): [r·V//T, (r+1)·V//T). V need not divide by T (GPT-3's 50257 does not):
    the shares then differ by one row. The runtime, its checkpoints, the memory estimate and the analytic profile
    all cut by this one rule."""
    t = tensor_parallel
    if not 0 <= rank < t:
        raise ValueError(f"tensor rank {rank} out of range for {t} ranks")
    return range(rank * vocab // t, (rank + 1) * vocab // t)


def vocab_share(vocab: int, tensor_parallel: int) -> int:
    """The most rows of `vocab_rows` one tensor rank holds: ⌈V / T⌉, the fullest device's share."""
    return -(-vocab // tensor_parallel)


def load_model_config(path: str | Path) -> ModelConfig:
    """Load ``[model]`` from a TOML file, or a bundled model by name (``tiny``, ``gpt3-13b``; `find_config`)."""
    path = find_config(path, "models", "--model")
    data = load_toml(path, "model config")
    table = data.get("model")
    if not isinstance(table, dict):
        raise UserError("missing the [model] table", where=str(path))
    return ModelConfig.from_dict(table, str(path))
