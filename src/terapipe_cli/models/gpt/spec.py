"""The GPT family's arch specs (torch-free; the modules are gpt/module.py's).

``arch = "gpt"`` (the default): the plain GPT decoder (nanoGPT's: LayerNorm, learned positions, a GELU MLP of
mlp_ratio·H, no biases in the linear layers), priced as Megatron's GPT-3 layer (biases and dropout) so that the
published settings plan as in the paper. Exported to `transformers` as a ``GPT2LMHeadModel`` that computes it exactly
(zero biases, the erf GELU, its own LM head).

``arch = "gpt2"``: GPT-2 exactly (`transformers`' ``GPT2LMHeadModel``): `gpt`'s layer with a bias in every linear
layer, the tanh GELU (``gelu_new``), LayerNorm's epsilon ``norm_eps`` (GPT-2's 1e-5) and, by default, the LM head
tied to the token embedding (``tie_embeddings``; tied, the embedding and the head must be on one device). Tensor
parallelism cuts the biases of the column-parallel layers (q/k/v, the MLP's first) with their weights; the
row-parallel layers' biases (the two output projections) are whole on every rank and added once, after the sum over
the ranks (engine/tensor.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from terapipe_cli.files import Fields
from terapipe_cli.models.spec import Arch, Gemm, HFKey, ModelConfig, Split, boolean, eot_token, unsupported


@dataclass(frozen=True)
class GptConfig(ModelConfig):
    """``arch = "gpt"``: the MLP's inner width is ``mlp_ratio`` · H; the LayerNorms have torch's epsilon and the head
    is its own."""

    mlp_ratio: int = 4
    arch: str = field(default="gpt", init=False)

    @property
    def ffn_hidden(self) -> int:
        return self.mlp_ratio * self.hidden

    @property
    def norm_eps(self) -> float:
        return 1e-5  # torch.nn.LayerNorm's default


@dataclass(frozen=True)
class Gpt2Config(GptConfig):
    """``arch = "gpt2"``: `GptConfig`'s width, GPT-2's LayerNorm epsilon and its head tied to the embedding by
    default (both settings here)."""

    arch: str = field(default="gpt2", init=False)
    norm_eps: float = 1e-5
    tie_embeddings: bool = True


# GPT-2's names. Its ``Conv1D`` stores a linear layer's weight as (in, out): transposed.
GPT2_KEYS: tuple[HFKey, ...] = (
    ("wte.weight", "transformer.wte.weight", False),
    ("wpe.weight", "transformer.wpe.weight", False),
    ("blocks.{n}.ln_1.weight", "transformer.h.{n}.ln_1.weight", False),
    ("blocks.{n}.ln_1.bias", "transformer.h.{n}.ln_1.bias", False),
    ("blocks.{n}.attn.qkv.weight", "transformer.h.{n}.attn.c_attn.weight", True),  # q, k, v in the same order
    ("blocks.{n}.attn.proj.weight", "transformer.h.{n}.attn.c_proj.weight", True),
    ("blocks.{n}.ln_2.weight", "transformer.h.{n}.ln_2.weight", False),
    ("blocks.{n}.ln_2.bias", "transformer.h.{n}.ln_2.bias", False),
    ("blocks.{n}.mlp.fc.weight", "transformer.h.{n}.mlp.c_fc.weight", True),
    ("blocks.{n}.mlp.proj.weight", "transformer.h.{n}.mlp.c_proj.weight", True),
    ("ln_f.weight", "transformer.ln_f.weight", False),
    ("ln_f.bias", "transformer.ln_f.bias", False),
    ("lm_head.weight", "lm_head.weight", False),  # left out when tied to the embedding (gpt2)
)
# GPT-2's linear biases, by their width in units of the hidden size H (None: the MLP's inner width).
GPT2_BIASES: tuple[tuple[str, str, int | None], ...] = (
    ("blocks.{n}.attn.qkv.bias", "transformer.h.{n}.attn.c_attn.bias", 3),
    ("blocks.{n}.attn.proj.bias", "transformer.h.{n}.attn.c_proj.bias", 1),
    ("blocks.{n}.mlp.fc.bias", "transformer.h.{n}.mlp.c_fc.bias", None),
    ("blocks.{n}.mlp.proj.bias", "transformer.h.{n}.mlp.c_proj.bias", 1),
)

# The kernels one tile of the runtime's decoder layer launches on CUDA (`module.Block` with a K/V cache, as
# `engine.stage.StageRunner` runs it), op by op. Views (split, view, transpose, slicing the cache) launch none.
FORWARD_KERNELS = (
    ("ln_1", 1),
    ("qkv", 1),
    ("k, v into the K/V cache (two copies)", 2),
    ("q.contiguous()", 1),
    ("scaled_dot_product_attention", 1),
    ("heads back to (b, i, H): reshape copy", 1),
    ("attention proj", 1),
    ("residual add", 1),
    ("ln_2", 1),
    ("fc", 1),
    ("gelu", 1),
    ("mlp proj", 1),
    ("residual add", 1),
)
# Backward: every matrix product gives two (input and weight gradient), each parameter's gradient is added to
# its .grad (the tiles of a step accumulate), a layer norm's backward is two kernels (input; weight and bias), a
# tensor used twice sums its two gradients, and the fused attention's backward is a pre-processing kernel (the
# output·gradient row sums) plus the main one and a zero-fill of its gradient accumulator.
BACKWARD_KERNELS = (
    ("residual: x's two gradients summed (twice)", 2),
    ("mlp proj: dgrad, wgrad, .grad +=", 3),
    ("gelu backward", 1),
    ("fc: dgrad, wgrad, .grad +=", 3),
    ("ln_2: dx, dweight and dbias, two .grad +=", 4),
    ("attention proj: dgrad, wgrad, .grad +=", 3),
    ("reshape copy backward", 1),
    ("scaled_dot_product_attention backward", 3),
    ("K/V hand-back: own rows + later slices' share, earlier rows into the cache's gradient", 4),
    ("q, k, v gradients back into one (b, i, 3H) tensor", 2),
    ("qkv: dgrad, wgrad, .grad +=", 3),
    ("ln_1: dx, dweight and dbias, two .grad +=", 4),
)


class GptArch(Arch):
    name = "gpt"
    module = "terapipe_cli.models.gpt.module:GPT"
    config = GptConfig
    learned_positions = True
    records_arch = False  # the profiles and plans of GPT models are as before ``arch`` existed
    # The fused q/k/v weight is three matrices stacked along dim 0 (parts = 3): each rank keeps its heads' rows of
    # each of them.
    splits = {
        "attn.qkv.weight": Split(0, 3),
        "attn.proj.weight": Split(1),
        "mlp.fc.weight": Split(0),
        "mlp.proj.weight": Split(1),
        "wte.weight": Split(0, vocab=True),
        "lm_head.weight": Split(0, vocab=True),
    }
    hf_keys = GPT2_KEYS
    forward_kernels = FORWARD_KERNELS
    backward_kernels = BACKWARD_KERNELS
    # Under autocast (bf16/fp16): the two layer norms run in fp32, so the inputs of qkv and fc are cast (one kernel
    # each, and one backward each); each weight's 16-bit copy is made once per step (not per tile, StageRunner.step)
    # but its gradient is cast back to fp32 in every tile's backward (four kernels).
    autocast_kernels = (2, 2 + 4)
    # W's backward kernels: the four weights' wgrad and .grad += (8), the two layer norms' dweight-and-dbias and their
    # two .grad += (6); under autocast the four weight gradients' casts to fp32.
    weight_kernels = (8 + 6, 4)

    def read_fields(self, f: Fields) -> dict:
        return {"mlp_ratio": f.int("mlp_ratio", minimum=1, default=self.default("mlp_ratio"))}

    def params_per_layer(self, cfg: ModelConfig, tensor_parallel: int = 1, *, bias: bool = True) -> int:
        """Sharded: the Q/K/V and output projections and both MLP matrices (with their biases when ``bias``, as
        in GPT-3; the runtime's own model has none, as in nanoGPT). Replicated: the two layer norms (weight and
        bias) and the biases of the two row-parallel outputs."""
        H, t, inner = cfg.hidden, tensor_parallel, cfg.ffn_hidden
        sharded = 3 * H * H + H * H + H * inner + inner * H
        replicated = 4 * H
        if bias:
            sharded += 3 * H + inner
            replicated += 2 * H
        return sharded // t + replicated

    def end_params(self, cfg: ModelConfig, vocab_rows: int) -> tuple[int, int]:
        """The token and position tables; the final LayerNorm (weight and bias) and the head's own matrix, or none
        when it is the embedding's (tied)."""
        H = cfg.hidden
        return vocab_rows * H + cfg.seq_len * H, (0 if cfg.tie_embeddings else vocab_rows * H) + 2 * H

    def forward_gemms(self, cfg: ModelConfig, rows, one, t: int, attention: list[Gemm]) -> list[Gemm]:
        H, inner = float(cfg.hidden), cfg.ffn_hidden / t
        return [
            ("qkv", one, rows, one * 3 * H / t, one * H),
            *attention,
            ("proj", one, rows, one * H, one * H / t),
            ("fc1", one, rows, one * inner, one * H),
            ("fc2", one, rows, one * H, one * inner),
        ]

    def streams(self, cfg: ModelConfig, act, inner, scores, t: int, dtype_bytes: int) -> tuple[list, list]:
        """Megatron's layer: biases and dropout (a dropout mask is one byte per element)."""
        mask = 1.0 / dtype_bytes
        return [
            2 * act,  # layer norm 1
            2 * scores,  # scale + causal mask + softmax (fused; dense attention only)
            (2 + mask) * scores,  # attention dropout (dense attention only)
            (3 + mask) * act,  # bias + dropout + residual after the projection (fused)
            2 * act,  # layer norm 2
            2 * inner,  # bias + GeLU
            (3 + mask) * act,  # bias + dropout + residual after the MLP (fused)
        ], [
            3 * act,  # layer norm 1: read dy and x, write dx
            3 * scores,  # softmax: read dy and y, write dx (dense attention only)
            (2 + mask) * scores,  # attention dropout (dense attention only)
            (2 + mask) * act,  # residual + dropout
            3 * act,  # layer norm 2
            3 * inner,  # GeLU: read dy and x, write dx
            (2 + mask) * act,  # residual + dropout
        ]

    def activation_bytes_per_token(self, cfg: ModelConfig, dtype_bytes: int, tensor_parallel: int = 1) -> float:
        """Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", eq. 2, for
        fp16 with no sequence parallelism): s·b·h·(10 + 24/t) bytes per layer, plus 5·a·s²·b/t for the attention
        scores, softmax and dropout that a plain attention stores. The runtime's attention is PyTorch's fused kernel
        (`scaled_dot_product_attention`), which keeps the output and a log-sum-exp per query instead of any
        (query, key) matrix, so only the first term applies; its log-sum-exp (4·a/t bytes per token) is left out."""
        return cfg.hidden * (10 + 24 / tensor_parallel) * dtype_bytes / 2

    def shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        H, F, V = cfg.hidden, cfg.ffn_hidden, cfg.vocab
        return {
            "wte.weight": (V, H),
            "wpe.weight": (cfg.seq_len, H),
            "ln_1.weight": (H,),
            "ln_1.bias": (H,),
            "attn.qkv.weight": (3 * H, H),
            "attn.proj.weight": (H, H),
            "ln_2.weight": (H,),
            "ln_2.bias": (H,),
            "mlp.fc.weight": (F, H),
            "mlp.proj.weight": (H, F),
            "ln_f.weight": (H,),
            "ln_f.bias": (H,),
            "lm_head.weight": (V, H),
        }

    def hf_zero_tensors(self, cfg: ModelConfig) -> dict[str, int]:
        """GPT-2's linear biases, which this model does not have."""
        return {
            theirs.format(n=n): cfg.ffn_hidden if width is None else width * cfg.hidden
            for _, theirs, width in GPT2_BIASES
            for n in range(cfg.layers)
        }

    def from_transformers(self, f: Fields, seq_len: int | None) -> dict:
        """A ``GPT2LMHeadModel`` with the erf GELU, as ``gpt`` exports (`hf_config`): its own LM head and
        LayerNorm's default epsilon, as this layer computes; its linear biases must be zero (checked where the weights
        are read, `train.init_from`)."""
        if boolean(f, "tie_word_embeddings", True):
            raise unsupported(f, "tie_word_embeddings", True, "arch gpt (the erf GELU) has an LM head of its own")
        eps = f.number("layer_norm_epsilon", positive=True, default=1e-5)
        if eps != 1e-5:
            raise unsupported(f, "layer_norm_epsilon", eps, "arch gpt's LayerNorms have torch's 1e-5")
        return gpt2_fields(f, seq_len)

    def hf_config(self, cfg: ModelConfig) -> Any:
        """A GPT2Config made this model: the exact erf GELU (``activation_function = "gelu"``, not GPT-2's tanh
        ``gelu_new``), zero biases (`hf_zero_tensors`) and an LM head of its own."""
        return gpt2_config(cfg, activation="gelu", tied=False)


def gpt2_fields(f: Fields, seq_len: int | None) -> dict:
    """The fields a ``GPT2LMHeadModel``'s config gives both `gpt` and `gpt2` (its GELU and head apart), refused where
    its attention or MLP computes what these layers do not. Its position table has n_positions rows: sequences no
    longer than that."""
    positions = f.int("n_positions", minimum=1)
    if seq_len is not None and seq_len > positions:
        raise f.fail("n_positions", f"is {positions}: the position table holds no place for {seq_len} tokens")
    H = f.int("n_embd", minimum=1)
    for key, value in (
        ("scale_attn_by_inverse_layer_idx", False),
        ("reorder_and_upcast_attn", False),
        ("add_cross_attention", False),
        ("scale_attn_weights", True),
    ):
        if f.get(key, value) != value:
            raise unsupported(f, key, f.get(key), f"GPT-2's attention here has {key} = {str(value).lower()}")
    inner = f.get("n_inner", None)
    inner = 4 * H if inner is None else f.int("n_inner", minimum=1)
    if inner % H:
        raise unsupported(f, "n_inner", inner, f"the MLP's width must be a multiple of n_embd ({H})")
    return {
        "layers": f.int("n_layer", minimum=1),
        "hidden": H,
        "heads": f.int("n_head", minimum=1),
        "vocab": f.int("vocab_size", minimum=2),
        "seq_len": positions if seq_len is None else seq_len,
        "mlp_ratio": inner // H,
    }


def gpt2_config(cfg: ModelConfig, *, activation: str, tied: bool) -> Any:
    from terapipe_cli.extras import require

    transformers = require("transformers", where="--format hf")
    eot = eot_token(cfg.vocab)
    return transformers.GPT2Config(
        vocab_size=cfg.vocab,
        n_positions=cfg.seq_len,
        n_embd=cfg.hidden,
        n_layer=cfg.layers,
        n_head=cfg.heads,
        n_inner=cfg.ffn_hidden,
        activation_function=activation,
        layer_norm_epsilon=cfg.norm_eps,  # 1e-5 for gpt: torch.nn.LayerNorm's default, which its LayerNorms use
        resid_pdrop=0.0,  # terapipe trains without dropout
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=tied,
        bos_token_id=eot,
        eos_token_id=eot,
        architectures=["GPT2LMHeadModel"],
    )


# `transformers`' names for the tanh approximation GPT-2 uses (the two compute the same function).
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")


class Gpt2Arch(GptArch):
    name = "gpt2"
    module = "terapipe_cli.models.gpt.module:GPT2"
    config = Gpt2Config
    records_arch = True
    splits = {**GptArch.splits, "attn.qkv.bias": Split(0, 3), "mlp.fc.bias": Split(0)}
    hf_keys: tuple[HFKey, ...] = (*GPT2_KEYS, *((ours, theirs, False) for ours, theirs, _ in GPT2_BIASES))
    transformers_classes = ("GPT2LMHeadModel",)
    # The biases ride in the products (the GEMM's bias epilogue) forward; backward each bias's gradient is a sum over
    # the tokens and its .grad += (two kernels each, four biases). Under tensor parallelism the two row-parallel
    # biases are added after the all-reduce: two kernels more forward, left out (a few of about 15).
    forward_kernels = FORWARD_KERNELS
    backward_kernels = (*BACKWARD_KERNELS, ("four biases: the gradient's sum over the tokens, .grad +=", 8))
    autocast_kernels = (2, 2 + 4 + 4)  # and the four bias gradients cast back to fp32
    weight_kernels = (8 + 6 + 8, 4 + 4)  # gpt's and the four biases' (their sums, .grad += and casts)

    def read_fields(self, f: Fields) -> dict:
        return {
            "mlp_ratio": f.int("mlp_ratio", minimum=1, default=self.default("mlp_ratio")),
            "norm_eps": f.number("norm_eps", positive=True, default=self.default("norm_eps")),
            "tie_embeddings": boolean(f, "tie_embeddings", self.default("tie_embeddings")),
        }

    def params_per_layer(self, cfg: ModelConfig, tensor_parallel: int = 1, *, bias: bool = True) -> int:
        """`gpt`'s layer with its biases, always (``bias`` is ignored: this model has them)."""
        return super().params_per_layer(cfg, tensor_parallel, bias=True)

    def streams(self, cfg: ModelConfig, act, inner, scores, t: int, dtype_bytes: int) -> tuple[list, list]:
        """The runtime's GPT-2 layer: a pass over each product's output for its bias (the q/k/v and MLP biases on
        this rank's share, the output projections' whole, after the all-reduce), no dropout. Backward a bias's
        gradient reads the output gradient once."""
        qkv = 3 * act / t
        forward = [
            2 * act,  # layer norm 1
            2 * qkv,  # q/k/v bias
            2 * scores,  # scale + causal mask + softmax (dense attention only)
            2 * act,  # output projection's bias
            3 * act,  # residual add
            2 * act,  # layer norm 2
            2 * inner,  # fc bias
            2 * inner,  # tanh GELU
            2 * act,  # MLP projection's bias
            3 * act,  # residual add
        ]
        backward = [
            3 * act,  # layer norm 1: read dy and x, write dx
            qkv,  # q/k/v bias gradient: read dy
            3 * scores,  # softmax: read dy and y, write dx (dense attention only)
            act,  # output projection's bias gradient
            2 * act,  # residual: the two gradients summed
            3 * act,  # layer norm 2
            inner,  # fc bias gradient
            3 * inner,  # GELU: read dy and x, write dx
            act,  # MLP projection's bias gradient
            2 * act,  # residual
        ]
        return forward, backward

    def shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        H, F = cfg.hidden, cfg.ffn_hidden
        biases = {"attn.qkv.bias": (3 * H,), "attn.proj.bias": (H,), "mlp.fc.bias": (F,), "mlp.proj.bias": (H,)}
        return {**super().shapes(cfg), **biases}

    def hf_zero_tensors(self, cfg: ModelConfig) -> dict[str, int]:
        return {}

    def hf_config(self, cfg: ModelConfig) -> Any:
        return gpt2_config(cfg, activation="gelu_new", tied=cfg.tie_embeddings)

    def reads_transformers_as(self, f: Fields) -> Arch:
        """``gpt`` for the erf GELU (``activation_function = "gelu"``: how ``gpt`` exports), else GPT-2 itself."""
        if f.get("activation_function", "gelu_new") == "gelu":
            from terapipe_cli.models import arch_spec

            return arch_spec("gpt")
        return self

    def from_transformers(self, f: Fields, seq_len: int | None) -> dict:
        """A ``GPT2LMHeadModel``'s config: refused where it computes what this layer does not. Its position table
        has n_positions rows: sequences no longer than that."""
        activation = f.get("activation_function", "gelu_new")
        if activation not in TANH_GELU:
            raise unsupported(f, "activation_function", activation, "GPT-2's layer here is the tanh GELU (gelu_new)")
        return {
            **gpt2_fields(f, seq_len),
            "norm_eps": f.number("layer_norm_epsilon", positive=True, default=1e-5),
            "tie_embeddings": boolean(f, "tie_word_embeddings", True),
        }


ARCHS = (GptArch(), Gpt2Arch())  # what the registry holds of this family (`terapipe_cli.models.FAMILIES`)
