"""Hugging Face checkpoints <-> jaxrl: safetensors <-> params (config.json <-> ModelConfig: hf_config.py).

    cfg, params = load(d)                                 # max_seq_len = the checkpoint's max_position_embeddings
    cfg, params = load(d, base)                           # run-time fields (max_seq_len, dtype, ...) from base
    cfg = model_config(read_config(d), base)              # architecture from config.json, the rest from base
    params = load_params(d, cfg, shardings)               # memory-mapped; each device reads its own shard
    save(out_dir, params, cfg, dtype="bfloat16")          # safetensors + config.json that transformers loads

Architectures: Llama (incl. Llama 3 RoPE scaling), Qwen2/2.5, Qwen3, Qwen3-MoE and Qwen2-MoE. HF linear
weights are (out, in); jaxrl stores (in, out) with heads split (q (D, H, Hd), k/v (D, K, Hd), o (H, Hd,
D)) and stacked layers on a leading axis (an MoE model's counts groups of moe_every layers). Params are
float32 whatever the file holds. With `shardings`, each device's callback reads and converts only its
slice of the memory-mapped tensors, so no host holds a full float32 copy of the model.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import jax
import numpy as np

from jaxrl.config import ModelConfig
from jaxrl.config.errors import CheckpointError
from jaxrl.models import safetensors_io
from jaxrl.models.hf_config import (
    hf_config,
    model_config,
    read_config,
)

# Tensors a checkpoint may hold that the model does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ---------------------------------------------------------------------------------------------
# Tensor names and layouts

# our block-relative path -> (HF suffix after "model.layers.{i}.", layout kind)
_BLOCK = {
    ("attn", "q"): ("self_attn.q_proj.weight", "q"),
    ("attn", "k"): ("self_attn.k_proj.weight", "kv"),
    ("attn", "v"): ("self_attn.v_proj.weight", "kv"),
    ("attn", "o"): ("self_attn.o_proj.weight", "o"),
    ("attn", "q_bias"): ("self_attn.q_proj.bias", "bias"),
    ("attn", "k_bias"): ("self_attn.k_proj.bias", "bias"),
    ("attn", "v_bias"): ("self_attn.v_proj.bias", "bias"),
    ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", "id"),
    ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", "id"),
    ("attn_norm", "scale"): ("input_layernorm.weight", "id"),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", "id"),
    ("mlp", "gate"): ("mlp.gate_proj.weight", "T"),
    ("mlp", "up"): ("mlp.up_proj.weight", "T"),
    ("mlp", "down"): ("mlp.down_proj.weight", "T"),
    ("moe", "router"): ("mlp.gate.weight", "T"),
    ("moe", "shared", "gate"): ("mlp.shared_expert.gate_proj.weight", "T"),
    ("moe", "shared", "up"): ("mlp.shared_expert.up_proj.weight", "T"),
    ("moe", "shared", "down"): ("mlp.shared_expert.down_proj.weight", "T"),
    ("moe", "shared_gate"): ("mlp.shared_expert_gate.weight", "T"),
}
_EXPERTS = {("moe", "gate"): "gate_proj", ("moe", "up"): "up_proj", ("moe", "down"): "down_proj"}
_TOP = {
    ("embedding",): ("model.embed_tokens.weight", "id"),
    ("final_norm", "scale"): ("model.norm.weight", "id"),
    ("lm_head",): ("lm_head.weight", "T"),
}


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
        if keys[0] not in ("blocks", "tail"):
            if keys not in _TOP:
                raise KeyError(f"no HF tensor for param {'/'.join(keys)}")
            name, kind = _TOP[keys]
            return _Leaf(name, kind, a.shape)
        grouped = cfg.n_experts and keys[0] == "blocks"  # else one layer per unit (dense, or the MoE tail)
        rel = keys[2:] if grouped else keys[1:]
        if grouped:  # unit u is layers u*m .. u*m+m-1: dense_j is the (j+1)-th, moe the last
            offset = int(keys[1][len("dense_") :]) if keys[1].startswith("dense_") else m - 1
            layers = [u * m + offset for u in range(a.shape[0])]
        else:
            first = cfg.n_moe_layers * m if keys[0] == "tail" else 0
            layers = [first + u for u in range(a.shape[0])]
        per_unit = a.shape[1:]
        out = []
        for layer in layers:
            prefix = f"model.layers.{layer}."
            if rel in _EXPERTS:
                out.append(
                    [
                        _Leaf(f"{prefix}mlp.experts.{e}.{_EXPERTS[rel]}.weight", "T", per_unit[1:])
                        for e in range(per_unit[0])
                    ]
                )
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
    from jaxrl.models.transformer import abstract_params  # models/transformer imports nothing from here

    return abstract_params(cfg)


def check_tensors(tensors: dict, src_tree, cfg: ModelConfig, where: str) -> None:
    """Every tensor the model needs is present with the expected shape, and none is left unused."""
    wanted = {}
    for src in jax.tree.leaves(src_tree, is_leaf=lambda x: isinstance(x, (list, _Leaf))):
        for leaf in _leaves(src):
            wanted[leaf.name] = leaf
    for name, leaf in wanted.items():
        expected = _hf_shape(leaf.kind, leaf.shape)
        if name not in tensors:
            raise CheckpointError(
                f"{where}: tensor {name!r} is missing (expected shape {expected} for this config.json)"
            )
        if tuple(tensors[name].shape) != expected:
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {tuple(tensors[name].shape)}, expected "
                f"{expected} (from config.json)"
            )
    unused = [
        n
        for n in tensors
        if n not in wanted and not n.endswith(_IGNORED_SUFFIXES) and not (cfg.tie_embeddings and n == "lm_head.weight")
    ]
    if unused:
        raise CheckpointError(
            f"{where}: tensor {sorted(unused)[0]!r} is not used by the model built from "
            f"config.json ({len(unused)} unused); is the architecture right?"
        )


def load_params(directory, cfg: ModelConfig, shardings=None):
    """float32 params of `cfg` from the safetensors of `directory`; placed by `shardings` if given
    (each device's callback reads only its slice of the memory-mapped tensors)."""
    tensors = safetensors_io.read_dir(directory)
    abstract = _abstract(cfg)
    src_tree = sources(cfg, abstract)
    check_tensors(tensors, src_tree, cfg, str(directory))

    def is_src(x):
        return isinstance(x, (list, _Leaf))

    if shardings is None:
        return jax.tree.map(lambda s: jax.numpy.asarray(_read(s, (), tensors)), src_tree, is_leaf=is_src)
    return jax.tree.map(
        lambda s, a, sh: jax.make_array_from_callback(
            a.shape,
            sh,
            lambda i: _read(s, () if i is None else i, tensors),  # None: the whole array
        ),
        src_tree,
        abstract,
        shardings,
        is_leaf=is_src,
    )


def load(directory, base: ModelConfig | None = None, shardings_fn=None):
    """(cfg, params) of a HF checkpoint directory; `shardings_fn(cfg)` -> shardings for the params.
    Run-time fields from `base`; without it, max_seq_len is the checkpoint's max_position_embeddings
    (see `model_config`). `cfg.hf_path` is "": checkpoints of one architecture share compiled functions."""
    cfg = model_config(read_config(directory), base, str(pathlib.Path(directory) / "config.json"))
    return cfg, load_params(directory, cfg, None if shardings_fn is None else shardings_fn(cfg))


# ---------------------------------------------------------------------------------------------
# Export


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

    def is_src(x):
        return isinstance(x, (list, _Leaf))

    for src, a in zip(jax.tree.leaves(src_tree, is_leaf=is_src), jax.tree.leaves(params)):
        put(src, jax.device_get(a))
    return out


def save(
    directory, params, cfg: ModelConfig, dtype: str = "float32", max_shard_bytes: int = 0, **config_extra
) -> list[str]:
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
