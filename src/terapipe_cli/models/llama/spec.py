"""``arch = "llama"``: the Llama-family decoder of llama/module.py (RMSNorm, rotary positions with Llama 3.1's optional
frequency scaling, a SwiGLU MLP of ffn_hidden, grouped-query attention, no biases). Exported as, and read from,
`transformers`' ``LlamaForCausalLM``; a ``MistralForCausalLM`` is the same layer when no sliding window cuts its
attention short."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from terapipe_cli.files import Fields
from terapipe_cli.models.spec import Arch, Gemm, HFKey, ModelConfig, Split, boolean, eot_token, unsupported


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rescaling of the rotary frequencies (``rope_type = "llama3"``, `transformers`'
    ``_compute_llama3_parameters``): a pair whose wavelength 2π/frequency is longer than
    ``original_max_position_embeddings / low_freq_factor`` turns ``factor`` times slower, one shorter than
    ``original_max_position_embeddings / high_freq_factor`` is kept, and those between are blended smoothly."""

    rope_type: str
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    @classmethod
    def read(cls, f: Fields, key: str = "rope_scaling", *, strict: bool = True) -> RopeScaling:
        """From a table (TOML) or an object (JSON; a ``config.json``'s ``rope_scaling`` or ``rope_parameters``, whose
        other keys are left to their reader: not ``strict``); one line naming the field at fault. Only the ``llama3``
        type is computed."""
        sub = f.sub(key)
        known = [field.name for field in fields(cls)]
        unknown = sorted(set(sub.obj) - set(known)) if strict else []
        if unknown:
            raise sub.fail(unknown[0], f"is not a setting of {key} (known: {', '.join(known)})")
        kind = sub.obj.get("rope_type", sub.obj.get("type"))
        if kind != "llama3":
            raise sub.fail("rope_type", f"must be 'llama3' (Llama 3.1's, the scaling terapipe computes), got {kind!r}")
        scaling = cls(
            rope_type=kind,
            factor=sub.number("factor", minimum=1.0),
            low_freq_factor=sub.number("low_freq_factor", positive=True),
            high_freq_factor=sub.number("high_freq_factor", positive=True),
            original_max_position_embeddings=sub.int("original_max_position_embeddings", minimum=1),
        )
        if scaling.high_freq_factor <= scaling.low_freq_factor:
            raise sub.fail("high_freq_factor", f"must exceed low_freq_factor ({scaling.low_freq_factor}), got "
                           f"{scaling.high_freq_factor}")  # fmt: skip
        return scaling


@dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    """``arch = "llama"``: grouped-query attention, the SwiGLU's width, the rotary base and scaling, RMSNorm's
    epsilon, and whether the head is the embedding's matrix."""

    arch: str = field(default="llama", init=False)
    kv_heads: int | None = None  # None: heads (multi-head attention)
    ffn_hidden: int | None = None  # the SwiGLU's inner width; None: 4 · hidden
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    rope_scaling: RopeScaling | None = None  # Llama 3.1's rescaled rotary frequencies; None: the plain ones

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        if isinstance(self.rope_scaling, dict):  # as `to_dict` writes it
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))


# (terapipe name, transformers name, transposed): the same tensors under `transformers`' names. No permutation:
# terapipe's RoPE is the rotate-half convention of `transformers`' Llama (llama/module.py).
LLAMA_KEYS: tuple[HFKey, ...] = (
    ("wte.weight", "model.embed_tokens.weight", False),
    ("blocks.{n}.attn_norm.weight", "model.layers.{n}.input_layernorm.weight", False),
    ("blocks.{n}.attn.q_proj.weight", "model.layers.{n}.self_attn.q_proj.weight", False),
    ("blocks.{n}.attn.k_proj.weight", "model.layers.{n}.self_attn.k_proj.weight", False),
    ("blocks.{n}.attn.v_proj.weight", "model.layers.{n}.self_attn.v_proj.weight", False),
    ("blocks.{n}.attn.o_proj.weight", "model.layers.{n}.self_attn.o_proj.weight", False),
    ("blocks.{n}.mlp_norm.weight", "model.layers.{n}.post_attention_layernorm.weight", False),
    ("blocks.{n}.mlp.gate_proj.weight", "model.layers.{n}.mlp.gate_proj.weight", False),
    ("blocks.{n}.mlp.up_proj.weight", "model.layers.{n}.mlp.up_proj.weight", False),
    ("blocks.{n}.mlp.down_proj.weight", "model.layers.{n}.mlp.down_proj.weight", False),
    ("norm.weight", "model.norm.weight", False),
    ("lm_head.weight", "lm_head.weight", False),  # left out when tied to the embedding
)

# The llama layer's kernels, counted as `gpt`'s from its ops (not yet timed on a GPU: the calibrated dispatch_s of a
# hardware file was fitted to the GPT counts).
FORWARD_KERNELS = (
    ("attn_norm (RMSNorm)", 1),
    ("q, k, v", 3),
    ("rotary angles: two aranges, the frequencies (pow, reciprocal), their product, cat, cos, sin", 8),
    ("rotate q and k: negation, cat, two products, sum", 10),
    ("k, v into the K/V cache (two copies)", 2),
    ("q.contiguous()", 1),
    ("scaled_dot_product_attention", 1),
    ("heads back to (b, i, H): reshape copy", 1),
    ("o_proj", 1),
    ("residual add", 1),
    ("mlp_norm (RMSNorm)", 1),
    ("gate, up", 2),
    ("silu, product", 2),
    ("down", 1),
    ("residual add", 1),
)
BACKWARD_KERNELS = (
    ("residual: x's two gradients summed (twice)", 2),
    ("down: dgrad, wgrad, .grad +=", 3),
    ("product and silu backward", 3),
    ("gate, up: dgrad, wgrad, .grad += each; their input gradients summed", 7),
    ("mlp_norm: dx, dweight, .grad +=", 3),
    ("o_proj: dgrad, wgrad, .grad +=", 3),
    ("reshape copy backward", 1),
    ("scaled_dot_product_attention backward", 3),
    ("K/V hand-back: own rows + later slices' share, earlier rows into the cache's gradient", 4),
    ("rotation backward of q and k: two products, the half's negation and placement, the sum", 8),
    ("q, k, v: dgrad, wgrad, .grad += each; their input gradients summed", 11),
    ("attn_norm: dx, dweight, .grad +=", 3),
)
# Llama 3.1's frequency scaling (llama/module.py's `scaled_frequencies`): the wavelengths, the two bands' masks and
# the blend, element-wise on head_dim/2 numbers per tile.
ROPE_SCALING_KERNELS = (("rotary frequencies rescaled (llama3): wavelengths, two bands, the blend", 18),)


class LlamaArch(Arch):
    name = "llama"
    module = "terapipe_cli.models.llama.module:Llama"
    config = LlamaConfig
    # Rank r keeps query heads [r·heads/T, (r+1)·heads/T) and key/value heads [r·kv_heads/T, (r+1)·kv_heads/T) —
    # exactly the ones its query heads read — and 1/T of the SwiGLU's width.
    splits = {
        "attn.q_proj.weight": Split(0),
        "attn.k_proj.weight": Split(0),
        "attn.v_proj.weight": Split(0),
        "attn.o_proj.weight": Split(1),
        "mlp.gate_proj.weight": Split(0),
        "mlp.up_proj.weight": Split(0),
        "mlp.down_proj.weight": Split(1),
        "wte.weight": Split(0, vocab=True),
        "lm_head.weight": Split(0, vocab=True),
    }
    hf_keys = LLAMA_KEYS
    transformers_classes = ("LlamaForCausalLM", "MistralForCausalLM")
    forward_kernels = FORWARD_KERNELS
    backward_kernels = BACKWARD_KERNELS
    # Under autocast: the norms' fp32 outputs cast for q, k, v, gate, up (five; five backward), cos and sin cast for q
    # and k (four), and seven weight gradients cast back to fp32.
    autocast_kernels = (5 + 4, 5 + 7)
    # W's backward kernels: the seven weights' wgrad and .grad += (14), the two RMSNorms' dweight and .grad += (4);
    # under autocast the seven weight gradients' casts to fp32.
    weight_kernels = (14 + 4, 7)

    def read_fields(self, f: Fields) -> dict:
        """ffn_hidden required; the rest with defaults (kv_heads: heads; RoFormer's base 10000; no rescaling)."""
        return {
            "kv_heads": f.int("kv_heads", minimum=1, default=f.int("heads", minimum=1)),
            "ffn_hidden": f.int("ffn_hidden", minimum=1),
            "rope_theta": f.number("rope_theta", positive=True, default=self.default("rope_theta")),
            "norm_eps": f.number("norm_eps", positive=True, default=self.default("norm_eps")),
            "tie_embeddings": boolean(f, "tie_embeddings", self.default("tie_embeddings")),
            "rope_scaling": RopeScaling.read(f) if f.get("rope_scaling", None) is not None else None,
        }

    def check(self, cfg: ModelConfig, f: Fields) -> None:
        if cfg.head_dim % 2:
            raise f.fail("heads", f"must leave an even head_dim for the rotary positions, got {cfg.head_dim}")

    def kernels(self, cfg: ModelConfig | None) -> tuple:
        fwd, bwd = self.forward_kernels, self.backward_kernels
        if cfg is not None and cfg.rope_scaling is not None:
            fwd = (*fwd, *ROPE_SCALING_KERNELS)
        return fwd, bwd

    def params_per_layer(self, cfg: ModelConfig, tensor_parallel: int = 1, *, bias: bool = True) -> int:
        """q and o of H·H, k and v of kv_heads·head_dim rows, SwiGLU's three H × ffn_hidden matrices, sharded; the
        two RMSNorm weights whole. No biases (``bias`` is ignored)."""
        H, t, inner = cfg.hidden, tensor_parallel, cfg.ffn_hidden
        return (2 * H * H + 2 * H * cfg.kv_width + 3 * H * inner) // t + 2 * H

    def end_params(self, cfg: ModelConfig, vocab_rows: int) -> tuple[int, int]:
        """The token embedding (no position table); the final RMSNorm and the head's matrix unless tied."""
        H = cfg.hidden
        return vocab_rows * H, (0 if cfg.tie_embeddings else vocab_rows * H) + H

    def forward_gemms(self, cfg: ModelConfig, rows, one, t: int, attention: list[Gemm]) -> list[Gemm]:
        """q, k, v apart (k and v of kv_heads·d features); SwiGLU's gate, up and down."""
        H, inner, kv = float(cfg.hidden), cfg.ffn_hidden / t, cfg.kv_width / t
        return [
            ("q", one, rows, one * H / t, one * H),
            ("k", one, rows, one * kv, one * H),
            ("v", one, rows, one * kv, one * H),
            *attention,
            ("proj", one, rows, one * H, one * H / t),
            ("gate", one, rows, one * inner, one * H),
            ("up", one, rows, one * inner, one * H),
            ("down", one, rows, one * H, one * inner),
        ]

    def streams(self, cfg: ModelConfig, act, inner, scores, t: int, dtype_bytes: int) -> tuple[list, list]:
        """RMSNorm, the rotation of q and k (x·cos, the rotated half: a negation and a concatenation, ·sin, the sum:
        9 passes over each), softmax (dense attention only), SwiGLU's silu and product, the residual adds. No
        biases, no dropout."""
        rotated = act / t * (cfg.heads + cfg.kv_heads) / cfg.heads  # bytes of q and k together
        forward = [2 * act, 9 * rotated, 2 * scores, 3 * act, 2 * act, 2 * inner, 3 * inner, 3 * act]
        # Backward: a norm reads dy and x and writes dx; the rotation runs its passes again on the gradients; softmax
        # reads dy and y and writes dx; silu reads dy and x, the product reads dy and both factors and writes two.
        backward = [3 * act, 9 * rotated, 3 * scores, 2 * act, 3 * act, 3 * inner, 5 * inner, 2 * act]
        return forward, backward

    def activation_bytes_per_token(self, cfg: ModelConfig, dtype_bytes: int, tensor_parallel: int = 1) -> float:
        """Counted from what the layer's ops save, per token, as the runtime runs it: each RMSNorm keeps its fp32
        input and normalised input (16H bytes for the two, replicated over the tensor ranks); the norms' outputs are
        saved by the projections that read them — once in fp32, or under autocast one 16-bit copy per projection
        (q, k, v, gate, up: 5·e·H); the rotation keeps cos and sin (2·d, fp32 shared by q and k, or one 16-bit copy
        each); attention keeps q, its output and the output projection's input (3H/t), and k and v
        (2·kv_heads·d/t: grouped-query attention keeps kv_heads/heads of a multi-head layer's); SwiGLU keeps the
        gate and up outputs, the silu and the product (4·ffn_hidden/t). No dropout masks. It equals what `terapipe
        profile` counts on a CPU (tests/profile/test_llama_profile.py); a CUDA build whose RMSNorm is one fused
        kernel keeps less (the normalised input: 8H), so the estimate is then high by that."""
        H, e, d, t = cfg.hidden, dtype_bytes, cfg.head_dim, tensor_parallel
        low = e < 4  # a 16-bit compute type under autocast; the residual stream and the norms stay fp32
        norms = 16 * H + (5 * e * H if low else 8 * H)
        rope = 2 * d * (2 * e if low else 4)
        return norms + rope + (3 * H + 2 * cfg.kv_width + 4 * cfg.ffn_hidden) / t * e

    def shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        H, F, V, kv = cfg.hidden, cfg.ffn_hidden, cfg.vocab, cfg.kv_width
        return {
            "wte.weight": (V, H),
            "attn_norm.weight": (H,),
            "attn.q_proj.weight": (H, H),
            "attn.k_proj.weight": (kv, H),
            "attn.v_proj.weight": (kv, H),
            "attn.o_proj.weight": (H, H),
            "mlp_norm.weight": (H,),
            "mlp.gate_proj.weight": (F, H),
            "mlp.up_proj.weight": (F, H),
            "mlp.down_proj.weight": (H, F),
            "norm.weight": (H,),
            "lm_head.weight": (V, H),
        }

    def hf_config(self, cfg: ModelConfig) -> Any:
        from terapipe_cli.extras import require

        transformers = require("transformers", where="--format hf")
        eot = eot_token(cfg.vocab)
        scaling = cfg.rope_scaling
        return transformers.LlamaConfig(
            vocab_size=cfg.vocab,
            hidden_size=cfg.hidden,
            intermediate_size=cfg.ffn_hidden,
            num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads,
            num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
            max_position_embeddings=cfg.seq_len,
            rms_norm_eps=cfg.norm_eps,
            rope_theta=cfg.rope_theta,
            rope_scaling=None if scaling is None else asdict(scaling),
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=cfg.tie_embeddings,
            bos_token_id=eot,
            eos_token_id=eot,
            architectures=["LlamaForCausalLM"],
        )

    def from_transformers(self, f: Fields, seq_len: int | None) -> dict:
        """A ``LlamaForCausalLM``'s or ``MistralForCausalLM``'s config (``rope_theta`` and ``rope_scaling`` as
        transformers 4 writes them, or 5's ``rope_parameters``); refused where it computes what this layer does
        not."""
        for key, value in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
            if f.get(key, value) != value:
                raise unsupported(f, key, f.get(key), f"the llama layer here has {key} = {value!r}")
        hidden, heads = f.int("hidden_size", minimum=1), f.int("num_attention_heads", minimum=1)
        head_dim = f.get("head_dim", None)
        if head_dim is not None and head_dim * heads != hidden:
            why = f"terapipe's heads have hidden_size / num_attention_heads = {hidden / heads:g} features"
            raise unsupported(f, "head_dim", head_dim, why)
        positions = f.int("max_position_embeddings", minimum=1)
        seq_len = positions if seq_len is None else seq_len
        window = f.get("sliding_window", None)
        if window is not None and window < seq_len:
            raise unsupported(f, "sliding_window", window, f"the layer here attends over all {seq_len} earlier tokens")
        rope = f.get("rope_parameters", None) or f.get("rope_scaling", None) or {}
        key = "rope_parameters" if f.get("rope_parameters", None) else "rope_scaling"
        kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
        if kind not in ("default", "llama3"):
            raise unsupported(f, key, kind, "terapipe computes the plain RoPE and Llama 3.1's scaling (llama3) only")
        if isinstance(rope, dict) and rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise unsupported(f, key, rope, "partial rotary embeddings are not computed")
        theta = f.get("rope_theta", None)
        theta = rope.get("rope_theta", 10000.0) if theta is None and isinstance(rope, dict) else theta
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
            raise f.fail("rope_theta", f"must be a positive number, got {theta!r}")
        return {
            "layers": f.int("num_hidden_layers", minimum=1),
            "hidden": hidden,
            "heads": heads,
            "vocab": f.int("vocab_size", minimum=2),
            "seq_len": seq_len,
            "kv_heads": f.int("num_key_value_heads", minimum=1, default=heads),
            "ffn_hidden": f.int("intermediate_size", minimum=1),
            "rope_theta": float(theta),
            "norm_eps": f.number("rms_norm_eps", positive=True, default=1e-6),
            "tie_embeddings": boolean(f, "tie_word_embeddings", False),
            "rope_scaling": RopeScaling.read(f, key, strict=False) if kind == "llama3" else None,
        }


ARCHS = (LlamaArch(),)  # what the registry holds of this family (`terapipe_cli.models.FAMILIES`)
