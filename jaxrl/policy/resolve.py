"""Which policy a config names, resolved in one place for training, `jaxrl eval` and LoRA rebuilds.

    tokenizer, model_cfg = resolve_policy(cfg)        # ResolvedPolicy
    shardings = shardings_for(model_cfg, mesh, preset)

`model.hf_path` names a Hugging Face checkpoint directory or a `jaxrl convert --from-hf` output: its
tokenizer, and its architecture with the run's run-time fields (`checkpoint_config`). Otherwise the
character tokenizer over the task's alphabet (an environment's own, else the arithmetic one), and
`model` with vocab_size filled in from it.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, NamedTuple

from jaxrl.config import Config, ConfigError, ModelConfig
from jaxrl.data.hf_tokenizer import load_tokenizer
from jaxrl.data.registry import get_task
from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.models import hf
from jaxrl.models.transformer import abstract_params, param_logical_axes
from jaxrl.sharding import param_shardings

MODEL_CONFIG = "model_config.json"
# ModelConfig fields a run chooses for itself, whatever the checkpoint says.
RUNTIME_FIELDS = ("max_seq_len", "dtype", "moe_dispatch", "capacity_factor", "moe_aux_coef", "moe_z_coef")


class ResolvedPolicy(NamedTuple):
    tokenizer: Any  # CharTokenizer, or model.hf_path's HFTokenizer
    model_cfg: ModelConfig  # vocab_size set; model.hf_path's architecture (hf_path "")


def resolve_policy(cfg: Config) -> ResolvedPolicy:
    """The tokenizer and model config of the policy `cfg` trains or evaluates."""
    if cfg.model.hf_path:
        model_cfg = checkpoint_config(cfg.model)  # first: a missing directory is an error naming model.hf_path
        tokenizer = load_tokenizer(pathlib.Path(cfg.model.hf_path).expanduser())
        if tokenizer.vocab_size > model_cfg.vocab_size:
            raise ConfigError(
                f"model.hf_path: the tokenizer has {tokenizer.vocab_size} ids but the model only "
                f"vocab_size={model_cfg.vocab_size}"
            )
        return ResolvedPolicy(tokenizer, model_cfg)
    tokenizer = CharTokenizer(get_task(cfg.data.task).char_alphabet)  # the task brings its alphabet
    model_cfg = cfg.model if cfg.model.vocab_size else dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size)
    return ResolvedPolicy(tokenizer, model_cfg)


def checkpoint_config(model: ModelConfig) -> ModelConfig:
    """The ModelConfig of `model.hf_path`: its architecture, `model`'s run-time fields, hf_path ""."""
    path = pathlib.Path(model.hf_path).expanduser()
    if not path.is_dir():
        raise ConfigError(f"model.hf_path: directory {str(path)!r} not found")
    if not (path / MODEL_CONFIG).is_file():
        return hf.model_config(hf.read_config(path), model, str(path / "config.json"))
    saved = json.loads((path / MODEL_CONFIG).read_text())
    if "hf_max_position_embeddings" not in saved and (path / "config.json").is_file():  # read it from config.json
        saved["hf_max_position_embeddings"] = hf.read_config(path).get("max_position_embeddings") or 0
    cfg = dataclasses.replace(
        ModelConfig.from_dict(saved), hf_path="", **{f: getattr(model, f) for f in RUNTIME_FIELDS}
    )
    cfg.validate()
    return cfg


def shardings_for(model_cfg: ModelConfig, mesh, preset) -> Any:
    """The params' NamedShardings under the mesh preset; a dimension that does not divide over its mesh
    axis is a ConfigError unless `mesh.allow_replicated` (carried by `preset`) names the parameter."""
    return param_shardings(mesh, preset, param_logical_axes(model_cfg), abstract_params(model_cfg))
