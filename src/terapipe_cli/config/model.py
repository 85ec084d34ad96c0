"""Model configurations: TOML files under ``configs/models/`` loaded into a validated dataclass.

[model]
name = "tiny"
layers = 4        # decoder layers N
hidden = 256      # H
heads = 4
vocab = 256
seq_len = 1024    # L
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

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def params_per_layer(self, tensor_parallel: int = 1, *, bias: bool = True) -> int:
        """Parameters of one decoder layer held by one device, with ``tensor_parallel`` ranks sharing the layer.

        Sharded: the Q/K/V and output projections and both MLP matrices (with their biases when ``bias``, as
        in GPT-3; the runtime's own model has none, as in nanoGPT). Replicated: the two layer norms (weight and
        bias) and the biases of the two row-parallel outputs.
        """
        H, t, inner = self.hidden, tensor_parallel, self.mlp_ratio * self.hidden
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
        inner = self.mlp_ratio * self.hidden
        if inner % t:
            raise UserError(f"{t} does not divide the MLP's {inner} inner features of model '{self.name}'", where=where)

    def to_dict(self) -> dict:
        return asdict(self)

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
        )
        if cfg.hidden % cfg.heads:
            raise f.fail("heads", f"must divide hidden ({cfg.hidden}), got {cfg.heads}")
        known = {"name", "layers", "hidden", "heads", "vocab", "seq_len", "mlp_ratio"}
        unknown = sorted(set(obj) - known)
        if unknown:
            raise f.fail(unknown[0], "is not a model setting (known: " + ", ".join(sorted(known)) + ")")
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

    def stage_counts(self) -> list[int]:
        """The stage counts K that divide the layers evenly, ascending (1, 2, 4, 5, 8, 10, 20, 40 for 40 layers)."""
        small = [k for k in range(1, int(self.layers**0.5) + 1) if self.layers % k == 0]
        return sorted({*small, *(self.layers // k for k in small)})


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
