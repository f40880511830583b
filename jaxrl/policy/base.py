"""The base policy a run starts from (`loop.build_run`'s first stage): the tokenizer, the model config,
the task, and the base params laid out by the mesh preset: a pretrained checkpoint (model.hf_path), a
run directory's newest checkpoint (warmstart.source='checkpoint'), or the cached warm-started policy
(trained once per task and model, jaxrl.policy.warmstart)."""

from __future__ import annotations

import pathlib

import jax
import numpy as np

from jaxrl.agents.formats import check_prompt_fits
from jaxrl.config import Config, ConfigError
from jaxrl.data.registry import get_task
from jaxrl.data.tasks import load_task
from jaxrl.multihost import is_primary, put_global
from jaxrl.policy.lora_run import newest_step_dir
from jaxrl.policy.pretrained import load_params, restore_saved_params
from jaxrl.policy.resolve import resolve_policy, shardings_for
from jaxrl.policy.warmstart import load_or_train_base


def build_base(cfg: Config, progress: bool, mesh, preset):
    """-> (tokenizer, model config, task, the base params laid out by the preset, the base's path, their
    shardings)."""
    tokenizer, model_cfg = resolve_policy(cfg)  # the task brings its alphabet (an environment's: its suite's)
    # The params' layout first: a dimension that does not divide its mesh axis is an error before any work.
    param_sh = shardings_for(model_cfg, mesh, preset)
    spec = get_task(cfg.data.task)
    alphabet = None if cfg.model.hf_path else tokenizer.alphabet  # records the character model cannot read
    if spec.episodic:  # a prompt that cannot fit is an error before the warm start, not after it
        task = load_task(cfg.data)
        if not cfg.model.hf_path:
            check_prompt_fits(cfg, tokenizer, spec.suite, None)
    elif jax.process_count() > 1:  # process 0 builds the dataset cache (if missing) before the others read it
        from jax.experimental import multihost_utils

        task = load_task(cfg.data, alphabet=alphabet) if is_primary() else None
        multihost_utils.sync_global_devices("jaxrl: dataset ready")
        task = task or load_task(cfg.data, alphabet=alphabet)
    else:
        task = load_task(cfg.data, alphabet=alphabet)
    # The base policy is restored straight into its sharded layout (param_sh).
    if cfg.model.hf_path:  # a pretrained checkpoint brings its tokenizer, architecture and weights
        base_path = pathlib.Path(cfg.model.hf_path)
        return tokenizer, model_cfg, task, load_params(base_path.expanduser(), model_cfg, param_sh), base_path, param_sh
    base_params, base_path = start_params(cfg, model_cfg, tokenizer, task.train, progress, param_sh)
    base_params = jax.tree.map(_placed, base_params, param_sh)
    return tokenizer, model_cfg, task, base_params, base_path, param_sh


def start_params(cfg: Config, model_cfg, tokenizer, train_source, progress: bool, shardings):
    """(params, path) a character-model run starts from: the newest checkpoint of the run directory
    warmstart.checkpoint (warmstart.source='checkpoint'), else the cached warm start (trained if missing).
    shardings: the params' layout (a pytree of NamedShardings)."""
    if cfg.warmstart.source != "checkpoint":
        return load_or_train_base(
            cfg, model_cfg, tokenizer, train_source, tokenizer.alphabet, progress=progress, shardings=shardings
        )
    if cfg.model.lora.enabled:
        raise ConfigError(
            "warmstart.source: 'checkpoint' is not available with model.lora (a LoRA run rebuilds its base from "
            "model.hf_path or the warm-start cache); export the run (jaxrl convert --to-hf) and set model.hf_path"
        )
    step_dir = newest_step_dir(pathlib.Path(cfg.warmstart.checkpoint).expanduser(), field="warmstart.checkpoint")
    params = restore_saved_params(
        step_dir,
        model_cfg,
        shardings,
        lambda why: ConfigError(
            f"warmstart.checkpoint: {step_dir}: its params do not restore as this run's model ({why})"
        ),
    )
    return params, step_dir


def _placed(x, sharding):
    """A host (or differently placed) array -> a global array laid out by `sharding`."""
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    return put_global(sharding, np.asarray(x))
