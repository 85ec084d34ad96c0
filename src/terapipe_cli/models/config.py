"""A model's settings (`ModelConfig`): the shapes every family has and what is computed from them, and how the
vocabulary's rows are cut over tensor ranks (`vocab_rows`). Reading a model TOML or a `transformers` folder is
`config.model`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from terapipe_cli.errors import UserError
from terapipe_cli.files import Fields
from terapipe_cli.models.llama.spec import RopeScaling
from terapipe_cli.models.spec import COMMON_FIELDS, Arch


@dataclass(frozen=True)
class ModelConfig:
    """A model's architecture and shapes: what decides its tensors and numbers, and so which plans, profiles,
    checkpoints and weights are its own. ``name`` labels it (a transformers folder's is the folder's) and is no part
    of that identity: two models equal when every other field does (`difference` names the first that does not)."""

    name: str = field(compare=False)
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
    tie_embeddings: bool | None = None  # None: the architecture's default (GPT-2 ties its head to the embedding)
    rope_scaling: RopeScaling | None = None  # Llama 3.1's rescaled rotary frequencies; None: the plain ones

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", self.mlp_ratio * self.hidden)
        if self.tie_embeddings is None:
            object.__setattr__(self, "tie_embeddings", self.spec.ties_by_default)
        if isinstance(self.rope_scaling, dict):  # as `to_dict` writes it (ModelConfig(**obj) by hand)
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

    @property
    def spec(self) -> Arch:
        """The architecture's spec (`terapipe_cli.models.ARCHS`): its module, splits, parameter and FLOP counts."""
        from terapipe_cli.models import arch_spec  # the registry imports every family, whose configs import this

        return arch_spec(self.arch)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        """Features of one token's keys (and of its values): kv_heads · head_dim; H with one K/V head per query head.
        The K/V cache of a grouped-query model is kv_heads / heads of the multi-head one's."""
        return self.kv_heads * self.head_dim

    def end_params(self, vocab_rows: int) -> tuple[int, int]:
        """Parameters of the embedding (chunk 0) and of the head (the last chunk, its final norm with it) holding
        ``vocab_rows`` rows of the vocabulary (the architecture's count; tied, the head's matrix is the embedding's,
        trained once)."""
        return self.spec.end_params(self, vocab_rows)

    def params_per_layer(self, tensor_parallel: int = 1, *, bias: bool = True) -> int:
        """Parameters of one decoder layer held by one device, with ``tensor_parallel`` ranks sharing the layer (the
        architecture's count: `terapipe_cli.models`). ``bias``: count GPT-3's biases for ``gpt``, whose runtime model
        has none (as nanoGPT); the other architectures count what they have."""
        return self.spec.params_per_layer(self, tensor_parallel, bias=bias)

    def check_tensor_parallel(self, tensor_parallel: int, where: str = "tensor_parallel") -> None:
        """T ranks split the heads and the MLP's inner dimension (docs/design.md §6b): T must divide both."""
        t = tensor_parallel
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise UserError(f"must be a positive integer, got {t!r}", where=where)
        if self.heads % t:
            raise UserError(f"{t} does not divide the {self.heads} heads of model '{self.name}'", where=where)
        if self.kv_heads % t:  # each rank keeps whole key/value heads, those its own query heads read
            raise UserError(f"{t} does not divide the {self.kv_heads} kv_heads of model '{self.name}'", where=where)
        inner = self.ffn_hidden
        if inner % t:
            raise UserError(f"{t} does not divide the MLP's {inner} inner features of model '{self.name}'", where=where)

    def difference(self, other: ModelConfig) -> tuple[str, object, object] | None:
        """The first field of the identity (every field but ``name``, each resolved: ``tie_embeddings`` is the
        architecture's default when not given) in which ``other`` differs: (field, other's value, this one's);
        None for the same model."""
        for f in fields(self):
            if f.compare and getattr(self, f.name) != getattr(other, f.name):
                return f.name, getattr(other, f.name), getattr(self, f.name)
        return None

    def to_dict(self) -> dict:
        """The fields a TOML or JSON file gives: the common ones, ``arch`` and the architecture's own (a GPT model's
        as before ``arch`` existed: its plans and profiles are unchanged)."""
        return self.spec.to_dict(self)

    @classmethod
    def from_dict(cls, obj: dict, where: str, prefix: str = "model.") -> ModelConfig:
        """Build and validate from a mapping (a TOML table or a JSON object); errors name ``where``."""
        f = Fields(obj, where, prefix)
        common = {
            "name": f.str("name"),
            "layers": f.int("layers", minimum=1),
            "hidden": f.int("hidden", minimum=1),
            "heads": f.int("heads", minimum=1),
            "vocab": f.int("vocab", minimum=2),
            "seq_len": f.int("seq_len", minimum=1),
        }
        from terapipe_cli.models import ARCHS

        arch = f.str("arch", default="gpt")
        if arch not in ARCHS:
            raise f.fail("arch", f"must be one of {', '.join(ARCHS)}, got {arch!r}")
        cfg = cls(**common, arch=arch, **ARCHS[arch].read_fields(f))
        cfg.check(f)
        known = {*COMMON_FIELDS, "arch", *cfg.spec.fields}
        unknown = sorted(set(obj) - known)
        if unknown:
            raise f.fail(unknown[0], f"is not a setting of arch = {cfg.arch!r} (known: {', '.join(sorted(known))})")
        return cfg

    def check(self, f: Fields) -> None:
        """What the fields must satisfy together (``f`` names the one at fault): the common rules, the spec's."""
        if self.hidden % self.heads:
            raise f.fail("heads", f"must divide hidden ({self.hidden}), got {self.heads}")
        if self.heads % self.kv_heads:
            raise f.fail("kv_heads", f"must divide heads ({self.heads}), got {self.kv_heads}")
        self.spec.check(self, f)

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
