"""Starting a run from a pretrained checkpoint (`model.hf_path`).

`model.hf_path` names either a Hugging Face checkpoint directory (config.json + safetensors +
tokenizer.json) or the output of `jaxrl convert --from-hf` (the same tokenizer files, model_config.json
and Orbax params). The architecture comes from the checkpoint; the run-time fields of `model` (dtype,
max_seq_len, MoE dispatch and loss coefficients) from the run's config. Either way the params are
placed straight into the mesh preset's shardings. The model config carries the checkpoint's own context
length (`hf_max_position_embeddings`) and RoPE scaling, so exporting a run trained at 1,024 tokens
writes the checkpoint's max_position_embeddings back, and it never holds the path (`hf_path` is ""):
the jitted functions that take it as a static argument compile once per architecture."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import orbax.checkpoint as ocp

from jaxrl.config import ConfigError, ModelConfig
from jaxrl.models import hf
from jaxrl.models.transformer import init_params, param_logical_axes

MODEL_CONFIG = "model_config.json"
# Files of a HF checkpoint that are not weights: copied along by `convert` in both directions.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",  # transformers 5 keeps the chat template here
)
# ModelConfig fields a run chooses for itself, whatever the checkpoint says.
RUNTIME_FIELDS = ("max_seq_len", "dtype", "moe_dispatch", "capacity_factor", "moe_aux_coef", "moe_z_coef")


def _shardings_fn(mesh, preset):
    from jaxrl.sharding import param_shardings

    def fn(cfg):
        abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
        return param_shardings(mesh, preset, param_logical_axes(cfg), abstract)

    return fn


def checkpoint_config(model: ModelConfig) -> ModelConfig:
    """The ModelConfig of `model.hf_path`: its architecture, `model`'s run-time fields, hf_path ""."""
    path = pathlib.Path(model.hf_path).expanduser()
    if not path.is_dir():
        raise ConfigError(f"model.hf_path: directory {str(path)!r} not found")
    if not (path / MODEL_CONFIG).is_file():
        return hf.model_config(hf.read_config(path), model, str(path / "config.json"))
    saved = json.loads((path / MODEL_CONFIG).read_text())
    if "hf_max_position_embeddings" not in saved and (path / "config.json").is_file():  # converted before it existed
        saved["hf_max_position_embeddings"] = hf.read_config(path).get("max_position_embeddings") or 0
    cfg = dataclasses.replace(
        ModelConfig.from_dict(saved), hf_path="", **{f: getattr(model, f) for f in RUNTIME_FIELDS}
    )
    cfg.validate()
    return cfg


def load_model(model: ModelConfig, shardings_fn=None):
    """(model_cfg, params) of `model.hf_path`; shardings_fn(cfg) -> the params' shardings (or None)."""
    path = pathlib.Path(model.hf_path).expanduser()
    cfg = checkpoint_config(model)
    if not (path / MODEL_CONFIG).is_file():
        return cfg, hf.load_params(path, cfg, None if shardings_fn is None else shardings_fn(cfg))
    abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    if shardings_fn is not None:
        abstract = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings_fn(cfg)
        )
    return cfg, ocp.StandardCheckpointer().restore((path / "params").absolute(), abstract)


def load_pretrained(model: ModelConfig, mesh, preset):
    """What `jaxrl train` needs from a pretrained checkpoint: (tokenizer, model_cfg, params placed by
    the preset, the checkpoint path, the params' shardings)."""
    from jaxrl.data.hf_tokenizer import load_tokenizer

    tokenizer = load_tokenizer(pathlib.Path(model.hf_path).expanduser())
    shardings_fn = _shardings_fn(mesh, preset)
    cfg, params = load_model(model, shardings_fn)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ConfigError(
            f"model.hf_path: the tokenizer has {tokenizer.vocab_size} ids but the model only "
            f"vocab_size={cfg.vocab_size}"
        )
    return tokenizer, cfg, params, pathlib.Path(model.hf_path), shardings_fn(cfg)
