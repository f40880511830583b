"""LoRA runs in the training loop (`model.lora.rank > 0`): the state, the policy, the checkpoints.

`TrainState.params` holds the adapters (the optimizer's moments cover them only) and `TrainState.base`
the frozen base in its storage dtype (jaxrl.models.lora.store_base). The policy, merge(base, adapters),
reaches the rollout and the evaluation through `policy_fn` (one jitted merge per step) and is merged
inside the update's gradient by the same function; the KL reference is merge(base, None), no copy held.
Checkpoints hold the state without its base plus, in their JSON item, the base's source and
fingerprint: a resume rebuilds the base as the run's start did and refuses another fingerprint.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax

from jaxrl.config import ConfigError
from jaxrl.config.lora import LoraConfig
from jaxrl.models import lora
from jaxrl.sharding import param_shardings
from jaxrl.train.state import TrainState, init_state, state_shardings

# fold_in(key(train.seed), this): the adapters' own stream, apart from the keys split from state.rng
# (the first rollout key is split(key(seed))[1]; A must not be drawn with it).
ADAPTER_STREAM = 0x4C6F5241  # "LoRA"
JSON_ITEM = "lora"  # the checkpoint JSON item's key: {"base_path": str, "fingerprint": [float, ...]}


class LoraRun(NamedTuple):
    """What the loop keeps about a LoRA run: its config, the model's logical axes, where the base came
    from and its fingerprint (computed once, saved with every checkpoint)."""

    cfg: LoraConfig
    logical: Any  # jaxrl.models.transformer.param_logical_axes(model_cfg)
    base_path: pathlib.Path
    fingerprint: list[float]


def adapter_key(seed: int) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed), ADAPTER_STREAM)


def initial_state(
    base_params: Any, optimizer: optax.GradientTransformation, seed: int, run: LoraRun, layout: tuple
) -> tuple[TrainState, TrainState, LoraRun]:
    """(state, its shardings, `run` with the base's fingerprint): adapters from `init_adapters` (B = 0:
    the policy is the base) and the base from `store_base`. layout = (mesh, preset, param_sh, rep):
    adapters and base are sharded by the preset's rules through their logical axes, as params are."""
    make_state, state_sh = state_layout(base_params, optimizer, seed, run, layout)
    state = jax.jit(make_state, in_shardings=(layout[2],), out_shardings=state_sh)(base_params)
    return state, state_sh, run._replace(fingerprint=lora.fingerprint(state.base))


def state_layout(
    base_params: Any, optimizer: optax.GradientTransformation, seed: int, run: LoraRun, layout: tuple
) -> tuple[Callable, TrainState]:
    """(make_state: base params -> the initial LoRA state, the state's shardings) for base params that
    may be abstract (`jaxrl plan`). layout = (mesh, preset, param_sh, rep)."""
    mesh, preset, _, rep = layout

    def make_state(params):
        adapters = lora.init_adapters(params, run.logical, run.cfg, adapter_key(seed))
        base = lora.store_base(params, run.logical, run.cfg)
        return init_state(adapters, optimizer, jax.random.key(seed), base=base)

    abstract = jax.eval_shape(make_state, base_params)
    adapter_sh = param_shardings(
        mesh, preset, lora.adapter_logical_axes(base_params, run.logical, run.cfg), abstract.params
    )
    base_sh = param_shardings(mesh, preset, lora.base_logical_axes(run.logical, run.cfg, base_params), abstract.base)
    return make_state, state_shardings(optimizer, abstract, adapter_sh, rep, base_sh)


def merge_fn(run: LoraRun | None) -> Callable | None:
    """(base, adapters or None) -> the float32 policy params; None for full fine-tuning."""
    if run is None:
        return None
    cfg, logical = run.cfg, run.logical
    return lambda base, adapters: lora.merge(base, adapters, cfg, logical)


def policy_fn(
    run: LoraRun | None, state_sh: TrainState, param_sh: Any, cast: Callable[[Any], Any] | None = None
) -> Callable[[TrainState], Any]:
    """state -> the params every rollout and evaluation forward uses: state.params for full
    fine-tuning; under LoRA one jitted merge laid out like the params (`param_sh`), so the samplers'
    jitted programs take it as they take full params. `cast` (params -> params, e.g. to the compute
    dtype) runs on them in the same program; None: none."""
    merge = merge_fn(run)
    if merge is None:
        if cast is None:
            return lambda state: state.params
        jitted_cast = jax.jit(cast, out_shardings=param_sh)
        return lambda state: jitted_cast(state.params)
    finish = cast or (lambda params: params)
    jitted = jax.jit(
        lambda base, adapters: finish(merge(base, adapters)),
        in_shardings=(state_sh.base, state_sh.params),
        out_shardings=param_sh,
    )
    return lambda state: jitted(state.base, state.params)


def checkpoint_item(run: LoraRun | None) -> dict:
    """The checkpoint JSON item's LoRA entry ({} for full fine-tuning)."""
    if run is None:
        return {}
    return {JSON_ITEM: {"base_path": str(run.base_path), "fingerprint": run.fingerprint}}


def check_resume(run: LoraRun | None, host: dict, step: int, directory: Any) -> None:
    """A ConfigError (one line) unless checkpoint `step`'s JSON item `host` fits this run: a LoRA run
    resumes only adapters trained on the same base (same fingerprint); a full fine-tuning run refuses
    a LoRA checkpoint and vice versa."""
    saved = host.get(JSON_ITEM)
    where = f"checkpoint {step} in {directory}"
    if run is None:
        if saved is not None:
            raise ConfigError(f"{where} holds LoRA adapters, but model.lora.rank is 0: set model.lora.* as trained")
        return
    if saved is None:
        raise ConfigError(
            f"{where} holds full parameters, not LoRA adapters: model.lora.rank > 0 needs a new --workdir"
        )
    if not lora.same_fingerprint(saved["fingerprint"], run.fingerprint):
        raise ConfigError(
            f"{where} holds adapters trained on the base {saved['base_path']!r}, but this run's base "
            f"{str(run.base_path)!r} has different weights: resume on the base it was trained on"
        )


def check_latest(manager: Any, run: LoraRun | None) -> None:
    """`check_resume` on the newest checkpoint's JSON item, read before the state is restored: a LoRA
    checkpoint does not restore into a full fine-tuning state (nor the reverse), and the restore's own
    error would not say why. An unreadable item is left to the restore to report."""
    import orbax.checkpoint as ocp

    step = manager.latest_step()
    if step is None:
        return
    try:
        host = manager.restore(step, args=ocp.args.Composite(host=ocp.args.JsonRestore()))["host"]
    except Exception:  # a damaged checkpoint: the restore sets it aside and tries an older one
        return
    check_resume(run, dict(host), step, manager.directory)
