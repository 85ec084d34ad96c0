"""``arch = "gpt2"``: GPT-2 exactly (`transformers`' ``GPT2LMHeadModel``): `gpt`'s layer with a bias in every linear
layer, the tanh GELU (``gelu_new``), LayerNorm's epsilon ``norm_eps`` (GPT-2's 1e-5) and, by default, the LM head
tied to the token embedding (``tie_embeddings``; tied, the embedding and the head must be on one device).

Tensor parallelism cuts the biases of the column-parallel layers (q/k/v, the MLP's first) with their weights; the
row-parallel layers' biases (the two output projections) are whole on every rank and added once, after the sum
over the ranks (engine/tensor.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from terapipe_cli.arch.base import Arch, HFKey, Split, boolean, unsupported
from terapipe_cli.arch.gpt import (
    BACKWARD_KERNELS,
    FORWARD_KERNELS,
    GPT2_BIASES,
    GPT2_KEYS,
    GptArch,
    gpt2_config,
    gpt2_fields,
)
from terapipe_cli.files import Fields

if TYPE_CHECKING:
    from terapipe_cli.config.model import ModelConfig

# `transformers`' names for the tanh approximation GPT-2 uses (the two compute the same function).
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")


class Gpt2Arch(GptArch):
    name = "gpt2"
    module = "terapipe_cli.engine.model:GPT2"
    fields = ("mlp_ratio", "norm_eps", "tie_embeddings")
    ties_by_default = True
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
            "mlp_ratio": f.int("mlp_ratio", minimum=1, default=4),
            "norm_eps": f.number("norm_eps", positive=True, default=1e-5),
            "tie_embeddings": boolean(f, "tie_embeddings", self.ties_by_default),
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
            from terapipe_cli.arch import arch_spec

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
