"""The base policy a run starts from (`loop.build_run`'s first stage): the tokenizer, the model config,
the task, and the base params laid out by the mesh preset: a pretrained checkpoint (model.hf_path), a
run directory's newest checkpoint (warmstart.source='checkpoint'), or the cached warm-started policy
(trained once per task and model, jaxrl.policy.warmstart)."""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxrl.agents.formats import check_prompt_fits
from jaxrl.config import Config, ConfigError
from jaxrl.config.errors import first_line
from jaxrl.data.registry import get_task
from jaxrl.data.tasks import load_task
from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.models.transformer import init_params, param_logical_axes
from jaxrl.policy.lora_run import newest_step_dir
from jaxrl.policy.pretrained import load_pretrained
from jaxrl.policy.warmstart import load_or_train_base
from jaxrl.sharding import is_primary, param_shardings, put_global


def build_base(cfg: Config, progress: bool, mesh, preset):
    """-> (tokenizer, model config, task, the base params laid out by the preset, the base's path, their
    shardings)."""
    spec = get_task(cfg.data.task)  # the task brings its alphabet (an environment's: its suite's)
    tokenizer = CharTokenizer(spec.char_alphabet)
    model_cfg = cfg.model if cfg.model.vocab_size else dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size)
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
    if cfg.model.hf_path:  # a pretrained checkpoint brings its tokenizer, architecture and weights
        tokenizer, model_cfg, base_params, base_path, param_sh = load_pretrained(cfg.model, mesh, preset)
        return tokenizer, model_cfg, task, base_params, base_path, param_sh
    # eval_shape -> shardings: the cached base policy is restored straight into its sharded layout.
    abstract_params = jax.eval_shape(lambda: init_params(model_cfg, jax.random.key(0)))
    param_sh = param_shardings(mesh, preset, param_logical_axes(model_cfg), abstract_params)
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
    abstract = jax.eval_shape(lambda: init_params(model_cfg, jax.random.key(0)))
    placed = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    target = {"params": placed}
    try:
        restored = ocp.PyTreeCheckpointer().restore(
            (step_dir / "state").absolute(),
            args=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
            ),
        )
    except Exception as e:  # orbax / tensorstore: damaged, another model's, or a LoRA run's adapters
        raise ConfigError(
            f"warmstart.checkpoint: {step_dir}: its params do not restore as this run's model ({first_line(e)})"
        ) from None
    return restored["params"], step_dir


def _placed(x, sharding):
    """A host (or differently placed) array -> a global array laid out by `sharding`."""
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    return put_global(sharding, np.asarray(x))
