"""What every model family shares: what its config has (`ModelConfig`, the shapes common to all and the structural
quantities generic code reads of any model), what its spec says (`Arch`), how the vocabulary's rows are cut over
tensor ranks (`vocab_rows`), the tensor-parallel `Split` of a parameter and the training FLOPs per token
(`flops_per_token`). No torch: the planner and the analytic profile read specs.

A family's `spec.py` holds its config (a `ModelConfig` subclass whose own fields are its settings) and its spec (an
`Arch` subclass naming that config, with one instance in the registry, `terapipe_cli.models.ARCHS`). The arch spec names
its torch module rather than importing it (``module = "terapipe_cli.models.gpt.module:GPT"``, imported by
`Arch.model_class` when a model is built). Reading a model TOML or a `transformers` folder is `config.model`'s.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any, NamedTuple

import numpy as np

from terapipe_cli.errors import UserError
from terapipe_cli.files import Fields


@dataclass(frozen=True)
class ModelConfig:
    """A model's architecture and shapes: what decides its tensors and numbers, and so which plans, profiles,
    checkpoints and weights are its own. ``name`` labels it (a transformers folder's is the folder's) and is no part
    of that identity: two models equal when every other field does (`difference` names the first that does not).

    The common part: each family's config adds its own settings and ``arch``, its name in the registry (a field
    fixed by the class). Generic code reads ``kv_heads``, ``ffn_hidden`` and ``tie_embeddings`` of every model: a
    family gives each as a setting or computes it (a GPT's inner width is mlp_ratio · H). `from_dict` builds the
    config the ``arch`` of a file names."""

    name: str = field(compare=False)
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int

    def __post_init__(self) -> None:
        if not hasattr(self, "arch"):
            raise TypeError("ModelConfig is what every family's config has: build a family's (GptConfig, LlamaConfig, "
                            "...) or read one with ModelConfig.from_dict")  # fmt: skip

    @property
    def spec(self) -> Arch:
        """The architecture's spec (`terapipe_cli.models.ARCHS`): its module, splits, parameter and FLOP counts."""
        from terapipe_cli.models import arch_spec  # the registry imports every family, whose configs import this module

        return arch_spec(self.arch)

    @property
    def kv_heads(self) -> int:
        """Key/value heads: one per query head (multi-head attention) unless the family groups them."""
        return self.heads

    @property
    def ffn_hidden(self) -> int:
        """The MLP's inner width (tensor parallelism cuts it)."""
        raise NotImplementedError(f"{type(self).__name__} says no MLP width")

    @property
    def tie_embeddings(self) -> bool:
        """Whether the LM head is the token embedding's matrix: not unless the family's settings say so."""
        return False

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
        """The first field of the identity (every field but ``name``) in which ``other`` differs: (field, other's
        value, this one's), the common shapes first, then ``arch``, then the family's settings; None for the same
        model."""
        common = [f.name for f in dataclasses.fields(ModelConfig) if f.compare]
        own = [f.name for f in dataclasses.fields(self) if f.compare and f.name not in common and f.name != "arch"]
        for name in [*common, "arch", *own]:
            if getattr(self, name) != getattr(other, name):
                return name, getattr(other, name), getattr(self, name)
        return None

    def to_dict(self) -> dict:
        """The fields a TOML or JSON file gives: the common ones, ``arch`` and the architecture's own (a GPT model's
        as before ``arch`` existed: its plans and profiles are unchanged)."""
        return self.spec.to_dict(self)

    @classmethod
    def from_dict(cls, obj: dict, where: str, prefix: str = "model.") -> ModelConfig:
        """Build and validate from a mapping (a TOML table, a JSON object, `to_dict`'s): the config of the family its
        ``arch`` names (default: gpt; called on a family's class, that family's); errors name ``where``."""
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

        arch = f.str("arch", default=getattr(cls, "arch", "gpt"))
        if arch not in ARCHS:
            raise f.fail("arch", f"must be one of {', '.join(ARCHS)}, got {arch!r}")
        spec = ARCHS[arch]
        if not issubclass(spec.config, cls):
            raise f.fail("arch", f"must be {cls.arch!r} here, got {arch!r}")
        cfg = spec.config(**common, **spec.read_fields(f))
        cfg.check(f)
        known = {*COMMON_FIELDS, "arch", *cfg.spec.fields}
        unknown = sorted(set(obj) - known)
        if unknown:
            raise f.fail(unknown[0], f"is not a setting of arch = {cfg.arch!r} (known: {', '.join(sorted(known))})")
        return cfg

    def check(self, f: Fields) -> None:
        """What the fields must satisfy together (``f`` names the one at fault): the common rules, the arch spec's."""
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


# The fields every family has; a family adds its own (`Arch.fields`).
COMMON_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))


GPT2_EOT = 50256  # GPT-2 BPE's <|endoftext|>: the exported configs' bos/eos id, kept only where the vocabulary holds it


def eot_token(vocab: int) -> int | None:
    """The bos/eos id a `transformers` config of a model with ``vocab`` ids names: GPT-2's <|endoftext|> where the
    vocabulary holds it, else none."""
    return GPT2_EOT if vocab > GPT2_EOT else None


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


# (terapipe name, transformers name, transposed): every weight of the model once; ``{n}`` is a layer's global index.
HFKey = tuple[str, str, bool]
# One matrix product: (name, batch count, m, n, k) with broadcastable numbers or numpy arrays; flops = 2·batch·m·n·k.
Gemm = tuple[str, Any, Any, Any, Any]
# The kernels one tile of one layer launches: (what, how many), op by op (`profile.analytic.kernels_per_tile`).
Kernels = tuple[tuple[str, int], ...]


class Split(NamedTuple):
    """How a tensor-parallel parameter is cut along ``dim``: ``parts`` equal blocks stacked there (the fused q, k, v),
    each cut evenly T ways; or, with ``vocab``, the vocabulary's rows cut by `models.vocab_rows` (unevenly
    when T does not divide V). Cut along the output features (dim 0 of a weight, a bias): column-parallel; along the
    input features (dim 1): row-parallel (engine/tensor.py)."""

    dim: int
    parts: int = 1
    vocab: bool = False


class Arch:
    """One architecture, everything the rest of terapipe asks of it (subclasses fill it in; one instance each).

    - the model: ``module`` (the torch class building a stage's part, named as ``"package.module:Class"``), its
      config (``config``, a `ModelConfig` subclass whose own fields are its settings, `fields`, read and checked by
      `read_fields` and `check`), how many parameters a layer and the two ends hold (`params_per_layer`,
      `end_params`);
    - tensor parallelism: ``splits``, how each cut parameter is cut, by the end of its name (engine/tensor.py);
    - the analytic profile: the layer's matrix products (`forward_gemms`), its element-wise byte streams
      (`streams`), the kernels it launches (``forward_kernels``, ..., ``weight_kernels``: a split backward's W's),
      what it keeps for the backward
      (`activation_bytes_per_token`), whether it has a position table (``learned_positions``);
    - `transformers`: the key table (``hf_keys``), the config it exports as (`hf_config`), the classes whose
      ``config.json`` it reads (``transformers_classes``, `from_transformers`).
    """

    name: str = ""
    module: str = ""
    config: type[ModelConfig] = ModelConfig
    records_arch = True  # `to_dict` writes ``arch`` (gpt's does not: its files are as before ``arch`` existed)
    learned_positions = False  # a position table beside the token embedding (chunk 0)
    splits: dict[str, Split] = {}
    hf_keys: tuple[HFKey, ...] = ()
    transformers_classes: tuple[str, ...] = ()
    forward_kernels: Kernels = ()
    backward_kernels: Kernels = ()
    autocast_kernels = (0, 0)  # more kernels forward and backward under autocast (bf16, fp16)
    # Of the backward's kernels, those a split backward's W runs (each weight's gradient product and its .grad +=, a
    # norm's weight (and bias) gradient and theirs), and of autocast's backward ones (the weights' gradients cast back
    # to fp32); the rest are I's (`profile.analytic.weight_kernels_per_tile`).
    weight_kernels = (0, 0)

    def model_class(self) -> type:
        """The torch module of this architecture (imports torch)."""
        path, cls = self.module.split(":")
        return getattr(importlib.import_module(path), cls)

    # --- the model's settings -------------------------------------------------------------------------------
    @property
    def fields(self) -> tuple[str, ...]:
        """The settings beyond `COMMON_FIELDS`, in order: the config's own fields (``arch`` apart)."""
        return tuple(f.name for f in dataclasses.fields(self.config) if f.init and f.name not in COMMON_FIELDS)

    def default(self, name: str) -> Any:
        """What a model that does not give the setting ``name`` gets (its config's default)."""
        return next(f.default for f in dataclasses.fields(self.config) if f.name == name)

    def read_fields(self, f: Fields) -> dict:
        """This architecture's settings from a TOML table or a JSON object, defaults filled in."""
        return {}

    def check(self, cfg: ModelConfig, f: Fields) -> None:
        """What the settings must satisfy together beyond `ModelConfig.check`'s rules (one line naming the field)."""

    def to_dict(self, cfg: ModelConfig) -> dict:
        """The fields a model file gives: the common ones, ``arch`` and this architecture's (None ones left out)."""
        keep = {*COMMON_FIELDS, *(["arch"] if self.records_arch else []), *self.fields}
        out = {}
        for f in dataclasses.fields(cfg):
            value = getattr(cfg, f.name)
            if f.name in keep and value is not None:
                out[f.name] = asdict(value) if is_dataclass(value) else value
        return out

    # --- parameters -----------------------------------------------------------------------------------------
    def params_per_layer(self, cfg: ModelConfig, tensor_parallel: int = 1, *, bias: bool = True) -> int:
        """Parameters of one layer on one of ``tensor_parallel`` ranks (``bias``: `ModelConfig.params_per_layer`)."""
        raise NotImplementedError

    def end_params(self, cfg: ModelConfig, vocab_rows: int) -> tuple[int, int]:
        """Parameters of the embedding and of the head (with its final norm) holding ``vocab_rows`` vocabulary rows."""
        raise NotImplementedError

    # --- the analytic profile ---------------------------------------------------------------------------------
    def forward_gemms(self, cfg: ModelConfig, rows, one, t: int, attention: list[Gemm]) -> list[Gemm]:
        """The layer's matrix products in the order it runs them, for ``rows`` tokens on one of ``t`` tensor ranks
        (``one``: ones of the tile grid's shape), with ``attention`` (the scores and the weighted sum, the same for
        every architecture) where the layer runs it."""
        raise NotImplementedError

    def streams(self, cfg: ModelConfig, act, inner, scores, t: int, dtype_bytes: int) -> tuple[list, list]:
        """The layer's element-wise kernels, bytes moved (read + write) forward and backward: ``act`` bytes of one
        b × i × H activation, ``inner`` of the MLP's inner one on one rank, ``scores`` of one score matrix (zero
        under fused attention)."""
        raise NotImplementedError

    def activation_bytes_per_token(self, cfg: ModelConfig, dtype_bytes: int, tensor_parallel: int = 1) -> float:
        """Bytes one layer keeps for its backward per token, on one of ``tensor_parallel`` ranks."""
        raise NotImplementedError

    def kernels(self, cfg: ModelConfig | None) -> tuple[Kernels, Kernels]:
        """The kernels one tile of one layer of ``cfg`` launches, forward and backward (None: the layer's usual)."""
        return self.forward_kernels, self.backward_kernels

    # --- transformers ---------------------------------------------------------------------------------------
    def hf_config(self, cfg: ModelConfig) -> Any:
        """The `transformers` config the model exports as (imports transformers)."""
        raise UserError(f"arch = {cfg.arch!r} has no transformers counterpart", where="--format hf")

    def hf_zero_tensors(self, cfg: ModelConfig) -> dict[str, int]:
        """Tensors the `transformers` model has and this one does not, written as zeros: name -> length."""
        return {}

    def transformers_names(self, cfg: ModelConfig) -> dict[str, tuple[str, bool]]:
        """Every tensor of ``cfg``'s model by terapipe name: (its `transformers` name, transposed) — the inverse of
        ``hf_keys``, layers numbered. A tied head is the embedding's tensor (`transformers` writes it once)."""
        out = {}
        for ours, theirs, transposed in self.hf_keys:
            for n in range(cfg.layers) if "{n}" in ours else [None]:
                out[ours.format(n=n)] = (theirs.format(n=n), transposed)
        if cfg.tie_embeddings and "lm_head.weight" in out:
            out["lm_head.weight"] = out["wte.weight"]
        return out

    def tensor_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor of ``cfg``'s single-device model (its state dict's names) with its shape, without building it
        (no torch): a layer's by the end of its name (`shapes`)."""
        table = self.shapes(cfg)
        return {
            name: table[name.split(".", 2)[2] if name.startswith("blocks.") else name]
            for name in self.transformers_names(cfg)
        }

    def shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The shape of each tensor by its name, a layer's without ``blocks.{n}.`` (`tensor_shapes`)."""
        raise NotImplementedError

    def reads_transformers_as(self, f: Fields) -> Arch:
        """The arch spec that reads this `transformers` config (``f``): this one, unless another computes it exactly (a
        ``GPT2LMHeadModel`` with the erf GELU is an export of ``gpt``)."""
        return self

    def from_transformers(self, f: Fields, seq_len: int | None) -> dict:
        """`ModelConfig`'s fields but ``name`` and ``arch`` from a `transformers` ``config.json`` (``f`` reads it;
        ``seq_len`` as given, None: the longest the model takes), or a one-line refusal naming the setting terapipe
        cannot compute exactly."""
        raise f.fail("architectures", f"names no architecture terapipe reads as {self.name!r}")


def boolean(f: Fields, key: str, default: bool) -> bool:
    """A true/false field (``default`` when absent), or one line naming it."""
    value = f.get(key, default)
    if not isinstance(value, bool):
        raise f.fail(key, f"must be true or false, got {value!r}")
    return value


def unsupported(f: Fields, key: str, value: Any, why: str) -> UserError:
    """A `transformers` setting terapipe cannot compute exactly, refused in one line naming it."""
    return f.fail(key, f"is {value!r}: {why}; terapipe cannot compute this model exactly")


def flops_per_token(cfg: ModelConfig, *, recompute: float = 0.0) -> float:
    """Training FLOPs per token of sequences of ``cfg.seq_len`` tokens: the numerator of MFU (PaLM, Chowdhery et
    al. 2022, appendix B): 6·N + 12·layers·H·L.

    N: the parameters that take part in a product for every token — the layers' weight matrices (the arch spec's
    `Arch.forward_gemms` at one token) and the LM head (the token embedding is a lookup, biases and norms are
    element-wise). 2·N forward, twice that backward. Attention: the scores and the weighted sum, 2·2·H per key per
    layer forward, over the whole L × L rectangle as PaLM and the dense kernels count (a causal fused kernel does
    about half). ``recompute``: the share of the layers whose forward runs again in the backward (1 or True: all)
    — 0 gives the model FLOPs (MFU), the plan's recomputed share the hardware FLOPs (HFU)."""
    matrices = sum(n * k for _, _, _, n, k in cfg.spec.forward_gemms(cfg, 1.0, 1.0, 1, []))
    weights = cfg.layers * matrices + cfg.vocab * cfg.hidden
    attention = 4.0 * cfg.layers * cfg.heads * cfg.head_dim * cfg.seq_len
    layers_forward = 2.0 * cfg.layers * matrices + attention
    return 3.0 * (2.0 * weights + attention) + float(recompute) * layers_forward


# The products of attention multiply two activations (Q·Kᵀ, P·V): both of their backward products are activations'
# gradients (dQ and dK, dP and dV, the K/V hand-back's too), so a split backward runs them all in I.
ACTIVATION_PRODUCTS = ("scores", "values")


def layer_gemms(cfg: ModelConfig, b, i, j, tensor_parallel: int = 1) -> list[Gemm]:
    """The matrix products of one layer's forward pass for a tile of b sequences × i new tokens after j: the
    architecture's own (`Arch.forward_gemms`) and attention's, the same for all.

    Per device with tensor parallelism t: the QKV and first MLP products are split by columns, the output
    and second MLP products by rows, attention by heads.
    """
    b, i, j = (np.asarray(x, dtype=float) for x in (b, i, j))
    t = tensor_parallel
    d, heads = float(cfg.head_dim), cfg.heads / t
    rows = b * i  # tokens of the tile: the m of every weight product
    one = np.ones_like(rows)
    ctx = i + j  # every new token attends over the context and its own slice's tokens
    # Scores Q·Kᵀ and the weighted sum P·V run over i × (i + j) per query head: causal masking does not shrink
    # the dense products that attention kernels of the time ran, so the full rectangle is counted. Grouped-query
    # attention changes neither: each query head still meets every key, its group's key/value head's.
    attention = [("scores", b * heads, i * one, ctx * one, one * d), ("values", b * heads, i * one, one * d, ctx * one)]
    return cfg.spec.forward_gemms(cfg, rows, one, t, attention)


def backward_gemms(forward: list[Gemm]) -> list[Gemm]:
    """Each forward product C = A·B needs dA = dC·Bᵀ (m × n · n × k) and dB = Aᵀ·dC (k × m · m × n).

    For attention, dB is the gradient of the keys/values — of the context slices too, which is what the
    runtime hands back to earlier slices.
    """
    out: list[Gemm] = []
    for name, batch, m, n, k in forward:
        out.append((f"{name}.dgrad", batch, m, k, n))
        out.append((f"{name}.wgrad", batch, k, n, m))
    return out


def is_weight_gradient(gemm: Gemm) -> bool:
    """Whether a backward product (`backward_gemms`) is a weight's gradient, W's in a split backward: a ``wgrad`` of
    a product with a weight (attention's are activations' gradients, `ACTIVATION_PRODUCTS`)."""
    name, kind = gemm[0].rsplit(".", 1)
    return kind == "wgrad" and name not in ACTIVATION_PRODUCTS


def backward_input_share(cfg: ModelConfig, b, i, j, tensor_parallel: int = 1) -> np.ndarray:
    """The architecture's analytic I : W ratio: the share of one layer's backward FLOPs in I (the input's and the
    K/V cache's gradients) for tiles (b, i, j), the rest W (the weights').

    Every product with a weight gives I its input's gradient and W its weight's, of the same FLOPs; attention's two
    products give I both of theirs (`ACTIVATION_PRODUCTS`), which grow with the context j, so the share does too.
    Element-wise kernels are not FLOPs and are left out (nearly all of them are I's: the norms', the activation's,
    the softmax's input gradients), so on a device where they cost time I's real share is a little higher. What a
    profile of schema /1, which timed the backward whole, is split by (`plan.costmodel.Profile.split_grids`)."""
    grads = backward_gemms(layer_gemms(cfg, b, i, j, tensor_parallel))
    weight = sum(2.0 * g[1] * g[2] * g[3] * g[4] for g in grads if is_weight_gradient(g))
    total = sum(2.0 * g[1] * g[2] * g[3] * g[4] for g in grads)
    return 1.0 - weight / total
