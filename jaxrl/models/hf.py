"""Hugging Face checkpoints <-> jaxrl: config.json <-> ModelConfig, safetensors <-> params.

    cfg = model_config(read_config(d), base)              # architecture from config.json, the rest from base
    params = load_params(d, cfg, shardings)               # memory-mapped; each device reads its own shard
    save(out_dir, params, cfg, dtype="bfloat16")          # safetensors + config.json that transformers loads

Architectures: Llama (incl. Llama 3 RoPE scaling), Qwen2/2.5 (q/k/v bias), Qwen3 (per-head q/k RMSNorm),
Qwen3-MoE and Qwen2-MoE (gated shared expert). HF linear weights are (out, in); jaxrl stores (in, out)
and splits heads: q (D, H, Hd), k/v (D, K, Hd), o (H, Hd, D); stacked layers carry a leading axis (an MoE
model's leading axis counts groups of moe_every layers: `dense_j` is layer g*moe_every + j, `moe` the
group's last). Params are float32 whatever the file holds (float32 or bfloat16 are both read).

With `shardings` (a NamedSharding per param, e.g. from `sharding.param_shardings`), every param is built
by `jax.make_array_from_callback` over memory-mapped tensors: each device's callback reads and converts
only its slice, so no host ever holds a full float32 copy of the model.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Optional

import jax
import numpy as np

from jaxrl.config import ModelConfig
from jaxrl.models import safetensors_io
from jaxrl.models.safetensors_io import CheckpointError

# HF architecture (config.json "architectures"[0]) -> family
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe"}
FAMILY_ARCH = {v: k for k, v in ARCHITECTURES.items()}
# Tensors a checkpoint may hold that the model does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_config(directory) -> dict:
    path = pathlib.Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: not found (expected a Hugging Face checkpoint directory)")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


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
    """rope_theta and the rescale fields, from transformers 5's `rope_parameters` or 4's `rope_theta` + `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    spec = {**scaling, **params}
    if spec.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(f"{source}: partial_rotary_factor={spec['partial_rotary_factor']} is not supported "
                              "(expected 1.0)")
    out = {"rope_theta": float(theta)}
    if kind == "default":
        return out
    if kind != "llama3":
        raise CheckpointError(f"{source}: rope scaling type {kind!r} is not supported (expected none or 'llama3')")
    try:
        return {**out, "rope_scaling": "llama3", "rope_scaling_factor": float(spec["factor"]),
                "rope_low_freq_factor": float(spec["low_freq_factor"]),
                "rope_high_freq_factor": float(spec["high_freq_factor"]),
                "rope_original_max_len": int(spec["original_max_position_embeddings"])}
    except KeyError as e:
        raise CheckpointError(f"{source}: llama3 rope scaling lacks {e.args[0]!r}") from None


def model_config(hf: dict, base: ModelConfig = ModelConfig(), source: str = "config.json") -> ModelConfig:
    """The ModelConfig of a HF config.json: architecture fields from `hf`, run-time fields (dtype,
    max_seq_len, MoE dispatch and loss coefficients, hf_path) kept from `base`. Anything the model
    cannot represent is a CheckpointError naming the config key."""
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
    heads = need("num_attention_heads")
    fields = dict(
        vocab_size=need("vocab_size"), d_model=need("hidden_size"), n_layers=need("num_hidden_layers"),
        n_heads=heads, n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or need("hidden_size") // heads, mlp_dim=need("intermediate_size"),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=fam == "qwen2" or (fam == "qwen2_moe" and bool(hf.get("qkv_bias", True))),
        qk_norm=fam in ("qwen3", "qwen3_moe"), **_rope(hf, source))
    fields.update(n_experts=0, n_shared_experts=0, router_norm_topk=True, shared_expert_gate=False, moe_every=1)
    if fam in ("qwen3_moe", "qwen2_moe"):
        n_experts = hf.get("num_experts", hf.get("num_local_experts"))
        if not n_experts:
            raise CheckpointError(f"{source}: 'num_experts' is missing or 0 ({FAMILY_ARCH[fam]} needs experts)")
        step = hf.get("decoder_sparse_step", 1)
        if hf.get("mlp_only_layers"):
            raise CheckpointError(f"{source}: mlp_only_layers={hf['mlp_only_layers']} is not supported (expected [];"
                                  " MoE layers must be every decoder_sparse_step-th layer)")
        if step < 1 or fields["n_layers"] % step:
            raise CheckpointError(f"{source}: decoder_sparse_step={step} must divide "
                                  f"num_hidden_layers={fields['n_layers']}")
        expert_dim = need("moe_intermediate_size")
        fields.update(n_experts=n_experts, experts_per_token=need("num_experts_per_tok"), expert_mlp_dim=expert_dim,
                      moe_every=step, router="softmax", router_norm_topk=bool(hf.get("norm_topk_prob", False)))
        shared = hf.get("shared_expert_intermediate_size", 0) if fam == "qwen2_moe" else 0
        if shared:
            if shared % expert_dim:
                raise CheckpointError(f"{source}: shared_expert_intermediate_size={shared} must be a multiple of "
                                      f"moe_intermediate_size={expert_dim}")
            fields.update(n_shared_experts=shared // expert_dim, shared_expert_gate=True)
    cfg = dataclasses.replace(base, **fields)
    cfg.validate()
    return cfg


# ---------------------------------------------------------------------------------------------
# Tensor names and layouts

# our block-relative path -> (HF suffix after "model.layers.{i}.", layout kind)
_BLOCK = {
    ("attn", "q"): ("self_attn.q_proj.weight", "q"), ("attn", "k"): ("self_attn.k_proj.weight", "kv"),
    ("attn", "v"): ("self_attn.v_proj.weight", "kv"), ("attn", "o"): ("self_attn.o_proj.weight", "o"),
    ("attn", "q_bias"): ("self_attn.q_proj.bias", "bias"), ("attn", "k_bias"): ("self_attn.k_proj.bias", "bias"),
    ("attn", "v_bias"): ("self_attn.v_proj.bias", "bias"),
    ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", "id"),
    ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", "id"),
    ("attn_norm", "scale"): ("input_layernorm.weight", "id"),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", "id"),
    ("mlp", "gate"): ("mlp.gate_proj.weight", "T"), ("mlp", "up"): ("mlp.up_proj.weight", "T"),
    ("mlp", "down"): ("mlp.down_proj.weight", "T"),
    ("moe", "router"): ("mlp.gate.weight", "T"),
    ("moe", "shared", "gate"): ("mlp.shared_expert.gate_proj.weight", "T"),
    ("moe", "shared", "up"): ("mlp.shared_expert.up_proj.weight", "T"),
    ("moe", "shared", "down"): ("mlp.shared_expert.down_proj.weight", "T"),
    ("moe", "shared_gate"): ("mlp.shared_expert_gate.weight", "T"),
}
_EXPERTS = {("moe", "gate"): "gate_proj", ("moe", "up"): "up_proj", ("moe", "down"): "down_proj"}
_TOP = {("embedding",): ("model.embed_tokens.weight", "id"), ("final_norm", "scale"): ("model.norm.weight", "id"),
        ("lm_head",): ("lm_head.weight", "T")}


def _to_ours(a: np.ndarray, kind: str, shape: tuple) -> np.ndarray:
    """A HF tensor -> a view in our layout of one layer's `shape` (no copy for memory-mapped input)."""
    if kind == "id":
        return a
    if kind == "T":
        return a.T
    if kind == "bias":
        return a.reshape(shape)
    if kind in ("q", "kv"):  # (N*Hd, D) -> (D, N, Hd)
        D, N, Hd = shape
        return a.reshape(N, Hd, D).transpose(2, 0, 1)
    H, Hd, D = shape  # o: (D, H*Hd) -> (H, Hd, D)
    return a.reshape(D, H, Hd).transpose(1, 2, 0)


def _from_ours(a: np.ndarray, kind: str) -> np.ndarray:
    if kind == "id":
        return a
    if kind == "T":
        return a.T
    if kind == "bias":
        return a.reshape(-1)
    if kind in ("q", "kv"):
        D, N, Hd = a.shape
        return a.transpose(1, 2, 0).reshape(N * Hd, D)
    H, Hd, D = a.shape
    return a.transpose(2, 0, 1).reshape(D, H * Hd)


def _hf_shape(kind: str, shape: tuple) -> tuple:
    return tuple(_from_ours(np.empty(shape, np.bool_), kind).shape)


@dataclasses.dataclass(frozen=True)
class _Leaf:
    name: str  # HF tensor name
    kind: str
    shape: tuple  # ours, of this one tensor


def sources(cfg: ModelConfig, abstract_params) -> Any:
    """The params tree with each leaf replaced by its HF tensors: a `_Leaf`, or nested lists of them
    along the stacked axes (layers / groups, then experts)."""
    m = cfg.moe_every if cfg.n_experts else 1

    def leaf(path, a):
        keys = tuple(k.key for k in path)
        if keys[0] != "blocks":
            if keys not in _TOP:
                raise KeyError(f"no HF tensor for param {'/'.join(keys)}")
            name, kind = _TOP[keys]
            return _Leaf(name, kind, a.shape)
        sub = keys[1] if cfg.n_experts else None
        rel = keys[2:] if cfg.n_experts else keys[1:]
        per_unit = a.shape[1:]
        out = []
        for u in range(a.shape[0]):
            layer = u * m + (int(sub[len("dense_"):]) if sub and sub.startswith("dense_") else m - 1)
            prefix = f"model.layers.{layer}."
            if rel in _EXPERTS:
                out.append([_Leaf(f"{prefix}mlp.experts.{e}.{_EXPERTS[rel]}.weight", "T", per_unit[1:])
                            for e in range(per_unit[0])])
            elif rel in _BLOCK:
                out.append(_Leaf(prefix + _BLOCK[rel][0], _BLOCK[rel][1], per_unit))
            else:
                raise KeyError(f"no HF tensor for param {'/'.join(keys)}")
        return out

    return jax.tree_util.tree_map_with_path(leaf, abstract_params)


def _leaves(src) -> list[_Leaf]:
    return [src] if isinstance(src, _Leaf) else [x for s in src for x in _leaves(s)]


def _read(src, index: tuple, tensors: dict) -> np.ndarray:
    """Our float32 array `index` (a tuple of slices) of a source tree."""
    if isinstance(src, _Leaf):
        view = _to_ours(tensors[src.name], src.kind, src.shape)
        return np.asarray(view[index], dtype=np.float32)
    first = index[0] if index else slice(None)
    return np.stack([_read(src[i], index[1:], tensors) for i in range(len(src))[first]])


def _abstract(cfg: ModelConfig):
    from jaxrl.models.transformer import init_params  # models/transformer imports nothing from here

    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))


def check_tensors(tensors: dict, src_tree, cfg: ModelConfig, where: str) -> None:
    """Every tensor the model needs is present with the expected shape, and none is left unused."""
    wanted = {}
    for src in jax.tree.leaves(src_tree, is_leaf=lambda x: isinstance(x, (list, _Leaf))):
        for l in _leaves(src):
            wanted[l.name] = l
    for name, l in wanted.items():
        expected = _hf_shape(l.kind, l.shape)
        if name not in tensors:
            raise CheckpointError(f"{where}: tensor {name!r} is missing (expected shape {expected} for this "
                                  f"config.json)")
        if tuple(tensors[name].shape) != expected:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {tuple(tensors[name].shape)}, expected "
                                  f"{expected} (from config.json)")
    unused = [n for n in tensors if n not in wanted and not n.endswith(_IGNORED_SUFFIXES)
              and not (cfg.tie_embeddings and n == "lm_head.weight")]
    if unused:
        raise CheckpointError(f"{where}: tensor {sorted(unused)[0]!r} is not used by the model built from "
                              f"config.json ({len(unused)} unused); is the architecture right?")


def load_params(directory, cfg: ModelConfig, shardings=None):
    """float32 params of `cfg` from the safetensors of `directory`; placed by `shardings` if given
    (each device's callback reads only its slice of the memory-mapped tensors)."""
    tensors = safetensors_io.read_dir(directory)
    abstract = _abstract(cfg)
    src_tree = sources(cfg, abstract)
    check_tensors(tensors, src_tree, cfg, str(directory))
    is_src = lambda x: isinstance(x, (list, _Leaf))  # noqa: E731
    if shardings is None:
        return jax.tree.map(lambda s: jax.numpy.asarray(_read(s, (), tensors)), src_tree, is_leaf=is_src)
    return jax.tree.map(lambda s, a, sh: jax.make_array_from_callback(a.shape, sh, lambda i: _read(s, i, tensors)),
                        src_tree, abstract, shardings, is_leaf=is_src)


def load(directory, base: ModelConfig = ModelConfig(), shardings_fn=None):
    """(cfg, params) of a HF checkpoint directory; `shardings_fn(cfg)` -> shardings for the params."""
    cfg = model_config(read_config(directory), dataclasses.replace(base, hf_path=str(directory)),
                       str(pathlib.Path(directory) / "config.json"))
    return cfg, load_params(directory, cfg, None if shardings_fn is None else shardings_fn(cfg))


# ---------------------------------------------------------------------------------------------
# Export


def export_family(cfg: ModelConfig) -> str:
    """The HF family that represents `cfg` exactly; CheckpointError naming the field that has none."""
    if cfg.n_experts:
        if cfg.router != "softmax":
            raise CheckpointError(f"model.router={cfg.router!r}: no Hugging Face MoE architecture here has it "
                                  "(expected 'softmax')")
        if cfg.n_shared_experts and not cfg.shared_expert_gate:
            raise CheckpointError("model.n_shared_experts > 0 needs model.shared_expert_gate=True to export "
                                  "(Qwen2-MoE's shared expert is gated)")
        if cfg.qk_norm and not cfg.qkv_bias and not cfg.n_shared_experts:
            return "qwen3_moe"
        if cfg.qkv_bias and not cfg.qk_norm:
            return "qwen2_moe"
        raise CheckpointError("model: an MoE model exports as Qwen3-MoE (qk_norm=True, qkv_bias=False, no shared "
                              "experts) or Qwen2-MoE (qkv_bias=True, qk_norm=False); got "
                              f"qk_norm={cfg.qk_norm}, qkv_bias={cfg.qkv_bias}, n_shared_experts={cfg.n_shared_experts}")
    if cfg.qk_norm and cfg.qkv_bias:
        raise CheckpointError("model: qk_norm=True with qkv_bias=True has no Hugging Face architecture here")
    return "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"


def hf_config(cfg: ModelConfig, dtype: str = "float32", **extra) -> dict:
    """config.json for `cfg` (transformers 4-style keys, which transformers 5 also reads)."""
    fam = export_family(cfg)
    out = {
        "architectures": [FAMILY_ARCH[fam]], "model_type": fam, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings, "max_position_embeddings": cfg.max_seq_len,
        "torch_dtype": dtype, "use_cache": True, "attention_dropout": 0.0,
    }
    if cfg.rope_scaling == "llama3":
        out["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor,
                               "low_freq_factor": cfg.rope_low_freq_factor,
                               "high_freq_factor": cfg.rope_high_freq_factor,
                               "original_max_position_embeddings": cfg.rope_original_max_len}
        out["max_position_embeddings"] = max(cfg.max_seq_len, int(cfg.rope_original_max_len * cfg.rope_scaling_factor))
    if fam in ("llama", "qwen3", "qwen3_moe"):
        out["attention_bias"] = False
    if fam == "llama":
        out["mlp_bias"] = False
    else:
        out["use_sliding_window"] = False
    if cfg.n_experts:
        out.update(num_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                   moe_intermediate_size=cfg.expert_mlp_dim or cfg.mlp_dim, decoder_sparse_step=cfg.moe_every,
                   mlp_only_layers=[], norm_topk_prob=cfg.router_norm_topk, output_router_logits=False,
                   router_aux_loss_coef=cfg.moe_aux_coef)
    if fam == "qwen2_moe":
        out.update(qkv_bias=True, shared_expert_intermediate_size=cfg.n_shared_experts * (cfg.expert_mlp_dim or cfg.mlp_dim))
    out.update({k: v for k, v in extra.items() if v is not None})
    return out


def hf_tensors(params, cfg: ModelConfig, dtype: str = "float32") -> dict[str, np.ndarray]:
    """{HF tensor name: numpy array in `dtype`} of `params` (fetched to this host)."""
    np_dtype = safetensors_io.DTYPES["BF16" if dtype == "bfloat16" else "F32"]
    src_tree = sources(cfg, _abstract(cfg))
    out = {}

    def put(src, a):
        if isinstance(src, _Leaf):
            out[src.name] = np.ascontiguousarray(_from_ours(np.asarray(a, np.float32), src.kind)).astype(np_dtype)
        else:
            for i, s in enumerate(src):
                put(s, a[i])

    is_src = lambda x: isinstance(x, (list, _Leaf))  # noqa: E731
    for src, a in zip(jax.tree.leaves(src_tree, is_leaf=is_src), jax.tree.leaves(params)):
        put(src, jax.device_get(a))
    return out


def save(directory, params, cfg: ModelConfig, dtype: str = "float32", max_shard_bytes: int = 0,
         **config_extra) -> list[str]:
    """Write config.json and safetensors (sharded with an index above `max_shard_bytes` > 0) that
    `transformers.AutoModelForCausalLM.from_pretrained(directory)` loads. `config_extra`: more
    config.json keys (e.g. bos_token_id, eos_token_id). Returns the files written."""
    if dtype not in ("float32", "bfloat16"):
        raise CheckpointError(f"export dtype {dtype!r}: expected 'float32' or 'bfloat16'")
    directory = pathlib.Path(directory)
    config = hf_config(cfg, dtype, **config_extra)
    files = safetensors_io.write_dir(directory, hf_tensors(params, cfg, dtype), max_shard_bytes)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return files + ["config.json"]
