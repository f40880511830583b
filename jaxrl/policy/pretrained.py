"""Starting a run from a pretrained checkpoint (`model.hf_path`): its params.

`model.hf_path` names either a Hugging Face checkpoint directory (config.json + safetensors +
tokenizer.json) or the output of `jaxrl convert --from-hf` (the same tokenizer files, model_config.json
and Orbax params). Its tokenizer and model config come from jaxrl.policy.resolve: the architecture from
the checkpoint, the run-time fields of `model` (dtype, max_seq_len, MoE dispatch and loss coefficients)
from the run's config. Either way the params are placed straight into the mesh preset's shardings. The
model config carries the checkpoint's own context length (`hf_max_position_embeddings`) and RoPE
scaling, so exporting a run trained at 1,024 tokens writes the checkpoint's max_position_embeddings
back, and it never holds the path (`hf_path` is ""): the jitted functions that take it as a static
argument compile once per architecture."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import orbax.checkpoint as ocp

from jaxrl.config import ModelConfig
from jaxrl.config.errors import first_line
from jaxrl.models import hf
from jaxrl.models.transformer import abstract_params
from jaxrl.policy.resolve import MODEL_CONFIG, checkpoint_config

# Files of a HF checkpoint that are not weights: copied along by `convert` in both directions.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",  # transformers 5 keeps the chat template here
)


def load_params(path: pathlib.Path, cfg: ModelConfig, shardings=None):
    """The params of the checkpoint at `path` (model config `cfg`), laid out by `shardings` (or None)."""
    if not (path / MODEL_CONFIG).is_file():
        return hf.load_params(path, cfg, shardings)
    return ocp.StandardCheckpointer().restore((path / "params").absolute(), abstract_params(cfg, shardings))


def load_model(model: ModelConfig, shardings_fn=None):
    """(model_cfg, params) of `model.hf_path`; shardings_fn(cfg) -> the params' shardings (or None)."""
    cfg = checkpoint_config(model)
    shardings = None if shardings_fn is None else shardings_fn(cfg)
    return cfg, load_params(pathlib.Path(model.hf_path).expanduser(), cfg, shardings)


def restore_saved_params(
    step_dir: pathlib.Path, model_cfg: ModelConfig, shardings, error: Callable[[str], Exception]
) -> Any:
    """The params of a run's saved TrainState in `step_dir`, laid out by `shardings` (an Orbax partial
    restore: the optimizer state stays on disk). A checkpoint that does not restore as `model_cfg`
    (damaged, another model's, a LoRA run's adapters) raises `error(why)`, the caller's one line."""
    target = {"params": abstract_params(model_cfg, shardings)}
    try:
        restored = ocp.PyTreeCheckpointer().restore(
            (step_dir / "state").absolute(),
            args=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
            ),
        )
    except Exception as e:  # orbax / tensorstore
        raise error(first_line(e)) from None
    return restored["params"]
