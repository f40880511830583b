"""`model.*`: the decoder's shape, dtype, MoE layout and attention options (re-exported by jaxrl.config)."""

import dataclasses
from typing import Any

from jaxrl.config.checks import _check
from jaxrl.config.lora import LoraConfig


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama/Qwen-style decoder. `vocab_size=0` means: take it from the tokenizer."""

    vocab_size: int = 0
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    mlp_dim: int = 384
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    max_seq_len: int = 64
    dtype: str = "float32"
    # The kernel of training, scoring and prefill attention (jaxrl.models.attention.KERNELS): auto (by
    # backend: cudnn on GPU, splash on TPU, cpu on CPU) | cpu (the einsum kernels) | xla | cudnn
    # (jax.nn.dot_product_attention with that implementation) | splash (Pallas TPU splash attention
    # for training and scoring, xla for prefill; off a TPU it runs Pallas' interpreter, for tests).
    # Decode keeps its own kernels.
    attention: str = "auto"
    # The kernel of the decode loops' cache read (jaxrl.models.decode_attention.DECODE_KERNELS): auto
    # (dense on CPU, blocked on GPU/TPU) | dense (every cache slot, masked; tuned for XLA:CPU) | blocked
    # (blocks of decode_block slots up to the batch's furthest filled slot, online softmax) | pallas
    # (a Pallas kernel bounded by each row's own fill; the interpreter on CPU).
    decode_attention: str = "auto"
    decode_block: int = 128  # cache slots per step of the blocked and pallas kernels
    # Mixture of experts (jaxrl.models.moe); n_experts=0 is the dense model, bit for bit.
    n_experts: int = 0
    moe_every: int = 1  # every moe_every-th layer is MoE (layers moe_every-1, 2*moe_every-1, ...)
    dense_tail_layers: int = 0  # MoE: dense layers after the last MoE group (HF's decoder_sparse_step not
    #                             dividing the layer count, or mlp_only_layers ending the stack)
    experts_per_token: int = 2
    expert_mlp_dim: int = 0  # 0 -> mlp_dim
    n_shared_experts: int = 0
    router: str = "softmax"  # softmax top-k renormalised (Qwen3-MoE) | sigmoid
    moe_dispatch: str = "dropless"  # dropless | capacity | naive
    capacity_factor: float = 1.25
    moe_aux_coef: float = 0.01
    moe_z_coef: float = 0.001
    # What real checkpoints add (jaxrl.models.hf maps them from config.json); defaults: the plain model.
    qkv_bias: bool = False  # q/k/v projections have a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim of each query/key head before RoPE (Qwen3)
    rope_scaling: str = "none"  # none | llama3 (Llama 3.1's frequency rescale, with the four fields below)
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    router_norm_topk: bool = True  # renormalise the top-k router gates to sum to 1 (False: Qwen2-MoE)
    shared_expert_gate: bool = False  # shared experts scaled by sigmoid(x @ w_Dx1) (Qwen2-MoE)
    # A local Hugging Face checkpoint directory: when set, `jaxrl train` takes the architecture fields
    # from its config.json and the initial params from its safetensors (see jaxrl.models.hf).
    hf_path: str = ""
    # The checkpoint's own context length (config.json max_position_embeddings; 0: not from a checkpoint).
    # Not used by the computation (max_seq_len is the run's length); export writes it back.
    hf_max_position_embeddings: int = 0
    # Low-rank adapters on the frozen base (jaxrl.models.lora); rank 0 (the default): full fine-tuning.
    lora: LoraConfig = LoraConfig()

    @classmethod
    def from_dict(cls, saved: dict) -> "ModelConfig":
        """A ModelConfig from its JSON form (a run's config.json `model`, a converted model_config.json):
        fields this version does not know are ignored, `lora` becomes its section, lists become tuples."""
        names = {f.name for f in dataclasses.fields(cls)}
        flat = {k: v for k, v in saved.items() if k in names and k != "lora"}
        lora = saved.get("lora") or {}
        lora_names = {f.name for f in dataclasses.fields(LoraConfig)}
        lora: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in lora.items() if k in lora_names}
        return cls(**flat, lora=LoraConfig(**lora))

    @property
    def n_moe_layers(self) -> int:
        return (self.n_layers - self.dense_tail_layers) // self.moe_every if self.n_experts else 0

    def validate(self, prefix: str = "model") -> None:
        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "max_seq_len"):
            v = getattr(self, name)
            _check(v > 0, f"{prefix}.{name}", "a positive integer", v)
        _check(
            self.vocab_size >= 0, f"{prefix}.vocab_size", "0 (from tokenizer) or a positive integer", self.vocab_size
        )
        _check(
            self.n_heads % self.n_kv_heads == 0,
            f"{prefix}.n_kv_heads",
            f"a divisor of n_heads={self.n_heads}",
            self.n_kv_heads,
        )
        _check(self.head_dim % 2 == 0, f"{prefix}.head_dim", "an even integer (RoPE rotates pairs)", self.head_dim)
        _check(self.rope_theta > 0, f"{prefix}.rope_theta", "a positive number", self.rope_theta)
        _check(self.dtype in ("float32", "bfloat16"), f"{prefix}.dtype", "'float32' or 'bfloat16'", self.dtype)
        self._validate_attention(prefix)
        self._validate_moe(prefix)
        self._validate_checkpoint_features(prefix)
        self.lora.validate(f"{prefix}.lora")

    def _validate_attention(self, prefix: str) -> None:
        decode = ("auto", "dense", "blocked", "pallas")  # = jaxrl.models.decode_attention.DECODE_KERNELS
        _check(
            self.decode_attention in decode,
            f"{prefix}.decode_attention",
            "'auto', 'dense', 'blocked' or 'pallas'",
            self.decode_attention,
        )
        _check(self.decode_block > 0, f"{prefix}.decode_block", "a positive integer", self.decode_block)
        kernels = ("auto", "cpu", "xla", "cudnn", "splash")  # = models.attention.KERNELS (config imports no model)
        expected = "'auto', 'cpu', 'xla', 'cudnn' or 'splash'"
        _check(self.attention in kernels, f"{prefix}.attention", expected, self.attention)
        if self.attention == "cudnn":
            _check(
                self.dtype == "bfloat16",
                f"{prefix}.attention",
                f"not 'cudnn' with {prefix}.dtype={self.dtype!r} (cuDNN flash attention takes 16-bit inputs; "
                f"set {prefix}.dtype=bfloat16 or attention=xla)",
                self.attention,
            )
            _check(
                self.head_dim % 8 == 0 and self.head_dim <= 256,
                f"{prefix}.attention",
                f"not 'cudnn' with {prefix}.head_dim={self.head_dim} (cuDNN needs a multiple of 8, <= 256 on "
                "Hopper and later, <= 128 before)",
                self.attention,
            )

    def _validate_checkpoint_features(self, prefix: str) -> None:
        _check(
            self.rope_scaling in ("none", "llama3"), f"{prefix}.rope_scaling", "'none' or 'llama3'", self.rope_scaling
        )
        _check(
            self.rope_scaling_factor >= 1, f"{prefix}.rope_scaling_factor", "a number >= 1", self.rope_scaling_factor
        )
        _check(
            self.rope_low_freq_factor > 0,
            f"{prefix}.rope_low_freq_factor",
            "a positive number",
            self.rope_low_freq_factor,
        )
        _check(
            self.rope_high_freq_factor > self.rope_low_freq_factor,
            f"{prefix}.rope_high_freq_factor",
            f"a number > rope_low_freq_factor={self.rope_low_freq_factor}",
            self.rope_high_freq_factor,
        )
        _check(
            self.rope_original_max_len > 0,
            f"{prefix}.rope_original_max_len",
            "a positive integer",
            self.rope_original_max_len,
        )
        _check(
            not self.shared_expert_gate or self.n_shared_experts > 0,
            f"{prefix}.shared_expert_gate",
            "False unless n_shared_experts > 0",
            self.shared_expert_gate,
        )
        _check(
            self.hf_max_position_embeddings >= 0,
            f"{prefix}.hf_max_position_embeddings",
            "0 (not from a checkpoint) or a positive integer",
            self.hf_max_position_embeddings,
        )

    def _validate_moe(self, prefix: str) -> None:
        _check(self.n_experts >= 0, f"{prefix}.n_experts", "0 (dense) or a positive integer", self.n_experts)
        tail = self.dense_tail_layers
        _check(
            tail == 0 or (self.n_experts > 0 and 0 < tail < self.n_layers),
            f"{prefix}.dense_tail_layers",
            f"0, or with n_experts > 0 an integer in [0, n_layers={self.n_layers})",
            tail,
        )
        what = f"n_layers - dense_tail_layers={self.n_layers - tail}" if tail else f"n_layers={self.n_layers}"
        _check(
            self.moe_every > 0 and (self.n_layers - tail) % self.moe_every == 0,
            f"{prefix}.moe_every",
            f"a positive divisor of {what}",
            self.moe_every,
        )
        _check(
            self.experts_per_token > 0 and (self.n_experts == 0 or self.experts_per_token <= self.n_experts),
            f"{prefix}.experts_per_token",
            f"an integer in [1, n_experts={self.n_experts}]",
            self.experts_per_token,
        )
        _check(
            self.expert_mlp_dim >= 0,
            f"{prefix}.expert_mlp_dim",
            "0 (= mlp_dim) or a positive integer",
            self.expert_mlp_dim,
        )
        _check(
            self.n_shared_experts >= 0, f"{prefix}.n_shared_experts", "a non-negative integer", self.n_shared_experts
        )
        _check(self.router in ("softmax", "sigmoid"), f"{prefix}.router", "'softmax' or 'sigmoid'", self.router)
        _check(
            self.moe_dispatch in ("dropless", "capacity", "naive"),
            f"{prefix}.moe_dispatch",
            "'dropless', 'capacity' or 'naive'",
            self.moe_dispatch,
        )
        _check(self.capacity_factor > 0, f"{prefix}.capacity_factor", "a positive number", self.capacity_factor)
        _check(self.moe_aux_coef >= 0, f"{prefix}.moe_aux_coef", "a non-negative number", self.moe_aux_coef)
        _check(self.moe_z_coef >= 0, f"{prefix}.moe_z_coef", "a non-negative number", self.moe_z_coef)
