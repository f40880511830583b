"""The base policy a run starts from (`loop.build_run`'s first stage): the tokenizer, the model config,
the task, and the base params laid out by the mesh preset: a pretrained checkpoint (model.hf_path), or
the cached warm-started policy (trained once per task and model, jaxrl.policy.warmstart)."""

from __future__ import annotations

import pathlib

import jax
import numpy as np

from jaxrl.agents import is_agent_task, load_suite
from jaxrl.agents.formats import check_prompt_fits
from jaxrl.agents.warmstart import load_agent_task
from jaxrl.config import Config
from jaxrl.data.tasks import load_task
from jaxrl.policy.pretrained import load_params
from jaxrl.policy.resolve import resolve_policy, shardings_for
from jaxrl.policy.warmstart import load_or_train_base
from jaxrl.sharding import is_primary, put_global


def build_base(cfg: Config, progress: bool, mesh, preset):
    """-> (tokenizer, model config, task, the base params laid out by the preset, the base's path, their
    shardings)."""
    tokenizer, model_cfg = resolve_policy(cfg)
    agent = is_agent_task(cfg.data.task)  # an environment suite brings its records
    if agent:  # a prompt that cannot fit is an error before the warm start, not after it
        task = load_agent_task(cfg.data)
        if not cfg.model.hf_path:
            check_prompt_fits(cfg, tokenizer, load_suite(cfg.data.task), None)
    elif jax.process_count() > 1:  # process 0 builds the dataset cache (if missing) before the others read it
        from jax.experimental import multihost_utils

        task = load_task(cfg.data) if is_primary() else None
        multihost_utils.sync_global_devices("jaxrl: dataset ready")
        task = task or load_task(cfg.data)
    else:
        task = load_task(cfg.data)
    # The base policy is restored straight into its sharded layout.
    param_sh = shardings_for(model_cfg, mesh, preset)
    if cfg.model.hf_path:  # a pretrained checkpoint brings its tokenizer, architecture and weights
        base_path = pathlib.Path(cfg.model.hf_path)
        return tokenizer, model_cfg, task, load_params(base_path.expanduser(), model_cfg, param_sh), base_path, param_sh
    base_params, base_path = load_or_train_base(
        cfg, model_cfg, tokenizer, task.train, tokenizer.alphabet, progress=progress, shardings=param_sh
    )
    base_params = jax.tree.map(_placed, base_params, param_sh)
    return tokenizer, model_cfg, task, base_params, base_path, param_sh


def _placed(x, sharding):
    """A host (or differently placed) array -> a global array laid out by `sharding`."""
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    return put_global(sharding, np.asarray(x))
