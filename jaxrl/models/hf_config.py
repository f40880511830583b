"""Hugging Face config.json <-> ModelConfig: which architectures load, and the config that exports.

    cfg = model_config(read_config(d))          # architecture from config.json; max_seq_len = its context
    cfg = model_config(read_config(d), base)    # ... the run-time fields (max_seq_len, dtype, MoE dispatch) from base
    json.dumps(hf_config(cfg))                  # config.json that transformers loads

The returned ModelConfig never holds the checkpoint's path (`hf_path` is ""): it is the static config
that jitted functions take, so two checkpoints of one architecture share their compiled functions.
It does hold the checkpoint's context length (`hf_max_position_embeddings`) and RoPE scaling, which
export writes back whatever length the run trained at.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from jaxrl.config import ModelConfig
from jaxrl.config.errors import CheckpointError

# HF architecture (config.json "architectures"[0]) -> family
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}
FAMILY_ARCH = {v: k for k, v in ARCHITECTURES.items()}


def read_config(directory) -> dict:
    path = pathlib.Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: not found (expected a Hugging Face checkpoint directory)")
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return config


def family(hf: dict, source: str = "config.json") -> str:
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if not archs and hf.get("model_type") in FAMILY_ARCH:
        return hf["model_type"]
    got = archs[0] if archs else f"model_type {hf.get('model_type')!r}"
    raise CheckpointError(f"{source}: architecture {got!r} is not supported; expected one of {sorted(ARCHITECTURES)}")


def _rope(hf: dict, source: str) -> dict:
    """rope_theta and the rescale fields, from transformers 5's `rope_parameters` or 4's `rope_theta` +
    `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    spec = {**scaling, **params}
    if spec.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(
            f"{source}: partial_rotary_factor={spec['partial_rotary_factor']} is not supported (expected 1.0)"
        )
    out = {"rope_theta": float(theta)}
    if kind == "default":
        return out
    if kind != "llama3":
        raise CheckpointError(f"{source}: rope scaling type {kind!r} is not supported (expected none or 'llama3')")
    try:
        return {
            **out,
            "rope_scaling": "llama3",
            "rope_scaling_factor": float(spec["factor"]),
            "rope_low_freq_factor": float(spec["low_freq_factor"]),
            "rope_high_freq_factor": float(spec["high_freq_factor"]),
            "rope_original_max_len": int(spec["original_max_position_embeddings"]),
        }
    except KeyError as e:
        raise CheckpointError(f"{source}: llama3 rope scaling lacks {e.args[0]!r}") from None


def _moe_layout(hf: dict, n_layers: int, source: str) -> tuple[int, int, int]:
    """(decoder_sparse_step, MoE layer count, trailing dense layers) of transformers' rule: layer i is MoE
    iff (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers. jaxrl's stack is groups of
    step layers ending in an MoE layer, then dense layers; other patterns are refused."""
    step, dense_only = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise CheckpointError(f"{source}: decoder_sparse_step={step!r} is not supported (expected a positive integer)")
    if not isinstance(dense_only, list):
        raise CheckpointError(f"{source}: mlp_only_layers={dense_only!r} is not a list of layer indices")
    moe = [i for i in range(n_layers) if (i + 1) % step == 0 and i not in dense_only]
    if moe != [g * step + step - 1 for g in range(len(moe))]:
        raise CheckpointError(
            f"{source}: mlp_only_layers={dense_only} makes layers {moe} MoE, which is not "
            f"supported (expected every decoder_sparse_step={step}-th layer from the first, "
            "dense layers only after the last MoE layer)"
        )
    return step, len(moe), n_layers - len(moe) * step


def _moe_fields(hf: dict, fam: str, n_layers: int, need, source: str) -> dict:
    """The MoE fields of a qwen2_moe / qwen3_moe config.json ({} when no layer is MoE: a dense model)."""
    n_experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not n_experts:
        raise CheckpointError(f"{source}: 'num_experts' is missing or 0 ({FAMILY_ARCH[fam]} needs experts)")
    step, n_moe, tail = _moe_layout(hf, n_layers, source)
    if not n_moe:  # transformers builds every layer dense: so do we (exported as the dense family)
        return {}
    expert_dim = need("moe_intermediate_size")
    fields = dict(
        n_experts=n_experts,
        experts_per_token=need("num_experts_per_tok"),
        expert_mlp_dim=expert_dim,
        moe_every=step,
        dense_tail_layers=tail,
        router="softmax",
        router_norm_topk=bool(hf.get("norm_topk_prob", False)),
    )
    shared = hf.get("shared_expert_intermediate_size", 0) if fam == "qwen2_moe" else 0
    if shared:
        if shared % expert_dim:
            raise CheckpointError(
                f"{source}: shared_expert_intermediate_size={shared} must be a multiple of "
                f"moe_intermediate_size={expert_dim}"
            )
        fields.update(n_shared_experts=shared // expert_dim, shared_expert_gate=True)
    return fields


def model_config(hf: dict, base: ModelConfig | None = None, source: str = "config.json") -> ModelConfig:
    """The ModelConfig of a HF config.json: architecture fields from `hf`, run-time fields (dtype,
    max_seq_len, MoE dispatch and loss coefficients) kept from `base`. Without `base`: ModelConfig's
    defaults, and max_seq_len = the checkpoint's max_position_embeddings. `hf_path` is always "".
    Anything the model cannot represent is a CheckpointError naming the config key."""
    fam = family(hf, source)

    def need(key):
        if key not in hf:
            raise CheckpointError(f"{source}: {key!r} is missing ({FAMILY_ARCH[fam]} needs it)")
        return hf[key]

    def reject(key, ok, expected):
        if key in hf and hf[key] is not None and not ok(hf[key]):
            raise CheckpointError(f"{source}: {key}={hf[key]!r} is not supported (expected {expected})")

    reject("hidden_act", lambda v: v == "silu", "'silu'")
    reject("use_sliding_window", lambda v: not v, "false")
    reject("mlp_bias", lambda v: not v, "false")
    # Llama's and Qwen3's attention_bias also puts a bias on o_proj, which the model does not have.
    reject("attention_bias", lambda v: not v or fam in ("qwen2", "qwen2_moe"), "false")
    reject("max_position_embeddings", lambda v: isinstance(v, int) and v > 0, "a positive integer")
    context = hf.get("max_position_embeddings") or 0
    if base is None:
        if not context:
            raise CheckpointError(
                f"{source}: 'max_position_embeddings' is missing; give the run's length as "
                "base=ModelConfig(max_seq_len=...)"
            )
        base = ModelConfig(max_seq_len=context)
    heads = need("num_attention_heads")
    fields: dict[str, Any] = dict(
        vocab_size=need("vocab_size"),
        d_model=need("hidden_size"),
        n_layers=need("num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or need("hidden_size") // heads,
        mlp_dim=need("intermediate_size"),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=fam == "qwen2" or (fam == "qwen2_moe" and bool(hf.get("qkv_bias", True))),
        qk_norm=fam in ("qwen3", "qwen3_moe"),
        hf_max_position_embeddings=context,
        hf_path="",
        **_rope(hf, source),
    )
    fields.update(
        n_experts=0,
        n_shared_experts=0,
        router_norm_topk=True,
        shared_expert_gate=False,
        moe_every=1,
        dense_tail_layers=0,
    )
    if fam in ("qwen3_moe", "qwen2_moe"):
        fields.update(_moe_fields(hf, fam, fields["n_layers"], need, source))
    cfg = dataclasses.replace(base, **fields)
    cfg.validate()
    return cfg


# ---------------------------------------------------------------------------------------------
# Export


def export_family(cfg: ModelConfig) -> str:
    """The HF family that represents `cfg` exactly; CheckpointError naming the field that has none."""
    if cfg.n_experts:
        if cfg.router != "softmax":
            raise CheckpointError(
                f"model.router={cfg.router!r}: no Hugging Face MoE architecture here has it (expected 'softmax')"
            )
        if cfg.n_shared_experts and not cfg.shared_expert_gate:
            raise CheckpointError(
                "model.n_shared_experts > 0 needs model.shared_expert_gate=True to export "
                "(Qwen2-MoE's shared expert is gated)"
            )
        if cfg.qk_norm and not cfg.qkv_bias and not cfg.n_shared_experts:
            return "qwen3_moe"
        if cfg.qkv_bias and not cfg.qk_norm:
            return "qwen2_moe"
        raise CheckpointError(
            "model: an MoE model exports as Qwen3-MoE (qk_norm=True, qkv_bias=False, no shared "
            "experts) or Qwen2-MoE (qkv_bias=True, qk_norm=False); got "
            f"qk_norm={cfg.qk_norm}, qkv_bias={cfg.qkv_bias}, n_shared_experts={cfg.n_shared_experts}"
        )
    if cfg.qk_norm and cfg.qkv_bias:
        raise CheckpointError("model: qk_norm=True with qkv_bias=True has no Hugging Face architecture here")
    return "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"


def max_positions(cfg: ModelConfig) -> int:
    """config.json's max_position_embeddings: the checkpoint's own (or, without one, what Llama 3 RoPE
    scaling was made for), never less than the length the run trained at."""
    known = cfg.hf_max_position_embeddings
    if not known and cfg.rope_scaling == "llama3":
        known = int(cfg.rope_original_max_len * cfg.rope_scaling_factor)
    return max(cfg.max_seq_len, known)


def _moe_config(cfg: ModelConfig) -> dict:
    """The MoE keys; trailing dense layers that transformers' step rule would make MoE go in mlp_only_layers."""
    step, moe_end = cfg.moe_every, cfg.n_layers - cfg.dense_tail_layers
    return dict(
        num_experts=cfg.n_experts,
        num_experts_per_tok=cfg.experts_per_token,
        moe_intermediate_size=cfg.expert_mlp_dim or cfg.mlp_dim,
        decoder_sparse_step=step,
        mlp_only_layers=[i for i in range(moe_end, cfg.n_layers) if (i + 1) % step == 0],
        norm_topk_prob=cfg.router_norm_topk,
        output_router_logits=False,
        router_aux_loss_coef=cfg.moe_aux_coef,
    )


def hf_config(cfg: ModelConfig, dtype: str = "float32", **extra) -> dict:
    """config.json for `cfg` (transformers 4-style keys, which transformers 5 also reads)."""
    fam = export_family(cfg)
    out = {
        "architectures": [FAMILY_ARCH[fam]],
        "model_type": fam,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": max_positions(cfg),
        "torch_dtype": dtype,
        "use_cache": True,
        "attention_dropout": 0.0,
    }
    if cfg.rope_scaling == "llama3":
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len,
        }
    if fam in ("llama", "qwen3", "qwen3_moe"):
        out["attention_bias"] = False
    if fam == "llama":
        out["mlp_bias"] = False
    else:
        out["use_sliding_window"] = False
    if cfg.n_experts:
        out.update(_moe_config(cfg))
    if fam == "qwen2_moe":
        out.update(
            qkv_bias=True, shared_expert_intermediate_size=cfg.n_shared_experts * (cfg.expert_mlp_dim or cfg.mlp_dim)
        )
    out.update({k: v for k, v in extra.items() if v is not None})
    return out
