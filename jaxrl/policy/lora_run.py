"""The policy of a LoRA run, rebuilt from its directory: what `jaxrl convert --to-hf` and `jaxrl eval` read.

A LoRA checkpoint holds the adapters (as `state.params`), the optimizer state, the step and the RNG, and in
its JSON item `"lora": {"base_path", "fingerprint"}`; the frozen base is not in it. The base is rebuilt
as training builds it: `model.hf_path`'s checkpoint, else the warm-start cache entry
(`warmstart.cache_root / cache_key`, a key that ignores `model.lora`), stored in `model.lora.base_dtype`
(the bf16 rounding or int8 quantisation the adapters were trained against), its fingerprint compared
with the one saved, and the policy is `lora.merge(base, adapters)` in float32 (int8 dequantised).

    run_config(run)                              # the run's Config, from its config.json
    policy = run_policy(run, step=None)          # newest step (or `step`): LoraPolicy(model_cfg, base, ...)
    policy.merged()                              # float32 params of the trained policy
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp

from jaxrl.config import Config, ConfigError
from jaxrl.config.load import override
from jaxrl.config.lora import LoraConfig
from jaxrl.models import lora
from jaxrl.models.transformer import abstract_params, param_logical_axes


class LoraPolicy(NamedTuple):
    model_cfg: Any  # the architecture (model.lora as the run's)
    lcfg: LoraConfig
    base: Any  # the frozen base in its storage dtype (lora.store_base)
    adapters: dict
    base_path: pathlib.Path  # the HF checkpoint or warm-start cache entry it was rebuilt from
    tokenizer_dir: pathlib.Path | None  # model.hf_path (tokenizer files), None for the character tokenizer

    def merged(self) -> Any:
        return lora.merge(self.base, self.adapters, self.lcfg, param_logical_axes(self.model_cfg))

    def dense_base(self) -> Any:
        return lora.dense_base(self.base)


def run_config(run: pathlib.Path) -> Config:
    """The run's Config from its config.json: the defaults with every saved field set (a field this jaxrl
    no longer has is ignored; a missing one keeps its default), then validated."""
    from jaxrl.config.saved import config_changes, read_run_config

    saved = read_run_config(run)
    if saved is None:
        raise ConfigError(f"--from {str(run)!r}: no config.json (not a jaxrl run directory)")
    cfg = Config()
    for field, (old, _) in config_changes(saved, cfg).items():
        cfg = override(cfg, field, tuple(old) if isinstance(old, list) else old)
    return cfg.validate()


def read_host(step_dir: pathlib.Path) -> dict:
    """The checkpoint's JSON item (data position, rollout state, and "lora" for a LoRA run)."""
    if not (step_dir / "host").is_dir():
        return {}
    return dict(ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore((step_dir / "host").absolute()))


def newest_step_dir(run: pathlib.Path, step: int | None = None, field: str = "--from") -> pathlib.Path:
    """<run>/checkpoints/<step>: the newest finished step, or `step` (an error listing the saved ones);
    `field` names where the run directory came from in the error."""
    root = run / "checkpoints"
    steps = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []
    if not steps:
        raise ConfigError(f"{field} {str(run)!r}: the run has no finished checkpoint")
    if step is not None and step not in steps:
        raise ConfigError(f"--step {step} was not saved in {root}; saved steps: {', '.join(map(str, steps))}")
    return root / str(steps[-1] if step is None else step)


def _warmstart_base(cfg: Config, shardings_fn):
    """(model_cfg, params, path) of the run's warm-start cache entry; a missing one is an error."""
    from jaxrl.policy.resolve import resolve_policy
    from jaxrl.policy.warmstart import cache_key, cache_root

    tokenizer, model_cfg = resolve_policy(cfg)
    # The key of the full fine-tuning run's base policy: a LoRA run shares it (model.lora is not in it).
    path = cache_root(cfg) / cache_key(cfg, dataclasses.replace(model_cfg, lora=LoraConfig()), tokenizer.alphabet)
    if not (path / "params").exists():
        raise ConfigError(
            f"the run's warm-start base {path} is missing: recreate it with `jaxrl eval` on the run's config "
            "(no --workdir: it trains and caches the base policy), or point warmstart.cache_dir / "
            "JAXRL_CACHE_DIR at the cache that holds it"
        )
    abstract = abstract_params(model_cfg, None if shardings_fn is None else shardings_fn(model_cfg))
    return model_cfg, ocp.StandardCheckpointer().restore((path / "params").absolute(), abstract), path


def rebuild_base(cfg: Config, shardings_fn=None):
    """(model_cfg, float32 base params, base path, tokenizer dir or None) as training builds them."""
    from jaxrl.policy.pretrained import load_model

    if cfg.model.hf_path:
        model_cfg, params = load_model(cfg.model, shardings_fn)
        path = pathlib.Path(cfg.model.hf_path).expanduser()
        return dataclasses.replace(model_cfg, lora=cfg.model.lora), params, path, path
    model_cfg, params, path = _warmstart_base(cfg, shardings_fn)
    return model_cfg, params, path, None


def restore_adapters(step_dir: pathlib.Path, abstract_adapters: Any) -> dict:
    """The adapters (the saved state's params) of one step; the optimizer state stays on disk."""
    from jaxrl.config.errors import first_line

    target = {"params": abstract_adapters}
    try:
        restored = ocp.PyTreeCheckpointer().restore(
            (step_dir / "state").absolute(),
            args=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
            ),
        )
    except Exception as e:  # orbax / tensorstore: damaged, or adapters of another rank / targets
        raise ConfigError(
            f"{step_dir}: its adapters do not restore as the run's model.lora.* ({first_line(e)})"
        ) from None
    return restored["params"]


def load_policy(cfg: Config, step_dir: pathlib.Path, mesh: Any = None, preset: Any = None) -> LoraPolicy:
    """The LoRA policy saved in `step_dir` by a run with config `cfg` (model.lora.rank > 0): the base
    rebuilt (laid out by the mesh preset when `mesh` is given), checked against the saved fingerprint,
    and the adapters restored."""
    from jaxrl.policy.resolve import shardings_for
    from jaxrl.sharding import param_shardings

    lcfg = cfg.model.lora
    if not lcfg.enabled:
        raise ConfigError(f"{step_dir}: not a LoRA run (model.lora.rank is 0)")

    shardings_fn = None if mesh is None else functools.partial(shardings_for, mesh=mesh, preset=preset)
    model_cfg, params, base_path, tokenizer_dir = rebuild_base(cfg, shardings_fn)
    logical = param_logical_axes(model_cfg)
    base = lora.store_base(params, logical, lcfg)
    saved = read_host(step_dir).get("lora") or {}
    if saved.get("fingerprint") and not lora.same_fingerprint(lora.fingerprint(base), saved["fingerprint"]):
        raise ConfigError(
            f"{step_dir}: its adapters were trained on another base than {base_path} (the weights' fingerprint "
            f"differs; the run recorded {saved.get('base_path')!r}): restore that base to export or evaluate it"
        )
    abstract_base = abstract_params(model_cfg)
    abstract = jax.eval_shape(lambda: lora.init_adapters(abstract_base, logical, lcfg, jax.random.key(0)))
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract)
    else:
        sh = param_shardings(mesh, preset, lora.adapter_logical_axes(abstract_base, logical, lcfg), abstract)
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, sh)
    adapters = restore_adapters(step_dir, abstract)
    return LoraPolicy(model_cfg, lcfg, base, adapters, base_path, tokenizer_dir)


def run_policy(run: pathlib.Path, step: int | None = None) -> LoraPolicy:
    """The LoRA policy of a run directory's newest checkpoint (or `step`), on the default device."""
    run = pathlib.Path(run)
    return load_policy(run_config(run), newest_step_dir(run, step))


def is_lora_run(run: pathlib.Path) -> bool:
    from jaxrl.config.saved import read_run_config

    saved = read_run_config(run) or {}
    return bool(((saved.get("model") or {}).get("lora") or {}).get("rank"))
