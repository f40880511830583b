"""LoRA in training (jaxrl.train.lora_state): the state holds adapters and a frozen base; one update
trains the adapters only (dense and MoE experts) and leaves the base bit for bit; at initialisation
the policy is the base bit for bit and the KL against the reference is exactly 0; the loop's rollouts
record the update's log-probs; checkpoints hold no base, resume exactly, and refuse another base;
the warm-start cache is shared with full fine-tuning.

The unit tests build the state as the loop does (`lora_state.initial_state` on a one-device mesh) on
the tiny models of tests/test_lora.py; one 3-step in-process run of the TINY default config covers
the loop (the resume reruns a copy of it whose newest checkpoint is gone, as test_reference_policy.py).
"""

import dataclasses
import functools
import json
import math
import pathlib
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import DEFAULT_CONFIG, TINY
from harness import child_env, run_python

from jaxrl import losses
from jaxrl.config import ConfigError, MeshConfig, ModelConfig, OptimConfig, load_config
from jaxrl.config.lora import LoraConfig
from jaxrl.models import lora
from jaxrl.models.transformer import forward, init_params, param_logical_axes
from jaxrl.policy.warmstart import cache_key
from jaxrl.sharding import make_mesh, param_shardings, replicated
from jaxrl.train import loop, lora_state
from jaxrl.train.state import make_optimizer
from jaxrl.train.steps import make_logp_fn, make_update_step

DENSE = ModelConfig(vocab_size=19, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, mlp_dim=24)
MOE = dataclasses.replace(DENSE, n_experts=3, moe_every=2, experts_per_token=2, n_shared_experts=1)
LORA = LoraConfig(rank=3, alpha=6.0)
B, P, T, G = 4, 3, 4, 2
SINGLE = MeshConfig()  # one device


def build(cfg: ModelConfig, lcfg: LoraConfig, mesh_cfg: MeshConfig = SINGLE):
    """As `loop.build_run` does: -> (base params, LoraRun, state, its shardings, optimizer, param_sh).
    The update does not donate the state (see update_fn): tests share one build per (cfg, lcfg, mesh)."""
    return _build(cfg, lcfg, mesh_cfg)  # one cache key whether mesh_cfg is passed or defaulted


@functools.cache
def _build(cfg: ModelConfig, lcfg: LoraConfig, mesh_cfg: MeshConfig):
    mesh, preset = make_mesh(mesh_cfg)
    params = init_params(cfg, jax.random.key(0))
    logical = param_logical_axes(cfg)
    param_sh = param_shardings(mesh, preset, logical, params)
    params = jax.device_put(params, param_sh)
    run = lora_state.LoraRun(lcfg, logical, pathlib.Path("base"), [])
    optimizer = make_optimizer(OptimConfig(learning_rate=0.05, warmup_steps=0), total_steps=10)
    state, state_sh, run = lora_state.initial_state(
        params, optimizer, 0, run, (mesh, preset, param_sh, replicated(mesh))
    )
    return params, run, state, state_sh, optimizer, param_sh


def batch(vocab: int = 19):
    rng = np.random.default_rng(0)
    return {
        "prompt_tokens_BxP": jnp.asarray(rng.integers(1, vocab, (B, P)), jnp.int32),
        "prompt_mask_BxP": jnp.ones((B, P), jnp.int32),
        "tokens_BxT": jnp.asarray(rng.integers(1, vocab, (B, T)), jnp.int32),
        "completion_mask_BxT": jnp.asarray(np.arange(T)[None] < np.array([[4], [2], [3], [4]]), jnp.float32),
        "rewards_BxK": jnp.asarray([[1.0], [0.0], [0.0], [1.0]]),
    }


def update_fn(cfg: ModelConfig, run, optimizer, kl_beta: float):
    """The loop's LoRA update, jitted; without the loop's donation, so that the tests can share one
    built state (the loop's runs below donate)."""
    loss = losses.PRESETS["grpo"](kl_beta=kl_beta)
    step = make_update_step(
        make_logp_fn(cfg, 1.0),
        loss,
        optimizer,
        ppo_epochs=1,
        microbatches=2,
        max_new_tokens=T,
        group_size=G,
        merge=lora_state.merge_fn(run),
    )
    return jax.jit(step)


def jitted_update(cfg: ModelConfig, lcfg: LoraConfig, mesh_cfg: MeshConfig = SINGLE):
    """update_fn (KL term on) for build(cfg, lcfg, mesh_cfg), compiled once for the tests that share it."""
    return _jitted(cfg, lcfg, mesh_cfg)[0]


def jitted_policy(cfg: ModelConfig, lcfg: LoraConfig, mesh_cfg: MeshConfig = SINGLE):
    """lora_state.policy_fn for build(cfg, lcfg, mesh_cfg), compiled once for the tests that share it."""
    return _jitted(cfg, lcfg, mesh_cfg)[1]


@functools.cache
def _jitted(cfg: ModelConfig, lcfg: LoraConfig, mesh_cfg: MeshConfig):
    """(update, policy) for build(cfg, lcfg, mesh_cfg); jitted lazily, so each compiles only if called."""
    _, run, _, state_sh, optimizer, param_sh = build(cfg, lcfg, mesh_cfg)
    return update_fn(cfg, run, optimizer, kl_beta=0.1), lora_state.policy_fn(run, state_sh, param_sh)


def _host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.mark.parametrize(
    "cfg,lcfg",
    [
        pytest.param(DENSE, LORA, id="dense"),
        pytest.param(MOE, dataclasses.replace(LORA, experts=True), id="moe_experts", marks=pytest.mark.slow),
        pytest.param(DENSE, dataclasses.replace(LORA, base_dtype="int8"), id="int8_base", marks=pytest.mark.slow),
    ],
)
def test_one_update_trains_only_the_adapters_and_kl_starts_at_exactly_zero(cfg, lcfg):
    _, run, state, _, optimizer, _ = build(cfg, lcfg)
    # The optimizer's moments are the adapters' shape: the base is not a variable of the update.
    mu = optimizer.init(state.params)[1][0].mu
    assert jax.tree.structure(state.opt_state[1][0].mu) == jax.tree.structure(mu)
    base_before, adapters_before = _host(state.base), _host(state.params)
    if lcfg.experts:  # the routed experts' own weights carry adapters too
        assert any(
            "expert" in jax.tree_util.keystr(p) or "moe" in jax.tree_util.keystr(p)
            for p, _ in jax.tree_util.tree_flatten_with_path(adapters_before)[0]
        )
    new, metrics = jitted_update(cfg, lcfg)(state, batch())
    assert float(metrics["kl"]) == 0.0  # adapters start at B = 0: the policy IS the reference
    assert float(metrics["grad_norm"]) > 0
    jax.tree.map(np.testing.assert_array_equal, _host(new.base), base_before)  # frozen, bit for bit
    assert jax.tree.structure(new.params) == jax.tree.structure(adapters_before)
    moved = [
        float(np.max(np.abs(np.asarray(n) - b)))
        for (path, n), b in zip(jax.tree_util.tree_flatten_with_path(new.params)[0], jax.tree.leaves(adapters_before))
        if path[-1].key == "b"
    ]
    assert min(moved) > 0  # every adapter's B got a gradient step (A's gradient is 0 while B is 0)


@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16", "int8"])
def test_the_initial_policy_is_the_stored_base_bit_for_bit(base_dtype):
    params, run, state, state_sh, _, param_sh = build(DENSE, dataclasses.replace(LORA, base_dtype=base_dtype))
    policy = jitted_policy(DENSE, dataclasses.replace(LORA, base_dtype=base_dtype))(state)
    # laid out like full params, so the rollout's jitted programs take it unchanged
    assert jax.tree.structure(policy) == jax.tree.structure(params)
    assert all(p.sharding == s for p, s in zip(jax.tree.leaves(policy), jax.tree.leaves(param_sh)))
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, 19, (2, 6)), jnp.int32)
    mask = jnp.ones((2, 6), jnp.int32)
    base = params if base_dtype == "float32" else lora.dense_base(state.base)
    np.testing.assert_array_equal(forward(policy, DENSE, tokens, mask), forward(base, DENSE, tokens, mask))
    if base_dtype == "bfloat16":
        assert all(w.dtype == jnp.bfloat16 for w in jax.tree.leaves(state.base))


def test_adapters_are_drawn_from_their_own_stream_of_the_seed():
    key0 = lora_state.adapter_key(0)
    assert not np.array_equal(jax.random.key_data(key0), jax.random.key_data(jax.random.split(jax.random.key(0))[1]))
    assert not np.array_equal(jax.random.key_data(key0), jax.random.key_data(lora_state.adapter_key(1)))


def test_warm_start_cache_key_ignores_lora():
    for model in (DENSE, MOE):
        cfg = load_config(DEFAULT_CONFIG, [])
        with_lora = dataclasses.replace(model, lora=LORA)
        assert cache_key(cfg, with_lora, "abc") == cache_key(cfg, model, "abc")


def test_the_lora_config_is_the_default_run_with_adapters_on_the_same_base():
    full = load_config(DEFAULT_CONFIG, [])
    cfg = load_config(DEFAULT_CONFIG.with_name("grpo_arithmetic_lora.py"), [])
    assert cfg.model.lora.rank == 8 and set(cfg.model.lora.targets) == {"q", "k", "v", "o", "gate", "up", "down"}
    assert cfg.optim.learning_rate == 1e-3
    assert dataclasses.replace(cfg, model=full.model, optim=full.optim) == full
    model = dataclasses.replace(full.model, vocab_size=20)
    assert cache_key(cfg, dataclasses.replace(cfg.model, vocab_size=20), "v") == cache_key(full, model, "v")


def test_resume_checks_name_the_mismatch():
    run = lora_state.LoraRun(LORA, None, pathlib.Path("/bases/one"), [1.0, 2.0])
    lora_state.check_resume(run, lora_state.checkpoint_item(run), 4, "ckpts")  # the same base: fine
    lora_state.check_resume(None, {"stream": {}}, 4, "ckpts")  # full fine-tuning: fine
    other = lora_state.checkpoint_item(run._replace(base_path=pathlib.Path("/bases/two"), fingerprint=[1.0, 2.5]))
    with pytest.raises(ConfigError, match=r"checkpoint 4 in ckpts .*'/bases/two'.*'/bases/one' has different"):
        lora_state.check_resume(run, other, 4, "ckpts")
    with pytest.raises(ConfigError, match="holds full parameters, not LoRA adapters"):
        lora_state.check_resume(run, {"stream": {}}, 4, "ckpts")
    with pytest.raises(ConfigError, match="holds LoRA adapters, but model.lora.rank is 0"):
        lora_state.check_resume(None, other, 4, "ckpts")


# ----------------------------------------------------------------------------- the training loop

STEPS = 3  # checkpoints at 2 and 3: the resume reruns step 3
OVERRIDES = [t for t in TINY if not t.startswith("train.eval_")] + [
    f"train.steps={STEPS}",
    "checkpoint.every=2",
    "train.eval_every=0",
    "train.eval_prompts=4",
    "loss.reward_weights=1,1",
    "loss.kl_beta=0.05",
    "optim.learning_rate=1e-2",
    "optim.warmup_steps=0",
    "model.lora.rank=4",
]
DETERMINISTIC = ("reward/mean", "loss", "grad_norm", "entropy", "clip_frac", "response_len/mean", "kl")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, cache_env, persistent_compile_cache):
    """A finished 3-step LoRA run with a KL term (checkpoints 2 and 3): (its config, workdir, rows)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXRL_DATA_DIR", cache_env["JAXRL_DATA_DIR"])
        mp.setenv("JAXRL_CACHE_DIR", cache_env["JAXRL_CACHE_DIR"])
        cfg = load_config(DEFAULT_CONFIG, OVERRIDES)
        workdir = tmp_path_factory.mktemp("lora") / "run"
        yield cfg, workdir, loop.train(cfg, workdir)


@pytest.mark.slow
def test_loop_kl_starts_at_zero_and_rollouts_record_the_updates_logprobs(lora_run):
    _, _, rows = lora_run
    assert rows[1]["kl"] == 0.0
    assert rows[-1]["kl"] > 0 and all(r["grad_norm"] > 0 for r in rows[1:])  # the adapters moved the policy
    # the rollout sampled the merged policy the update scores: the same log-probs up to float rounding
    assert all(r["mismatch_abs_logp"] < 1e-5 for r in rows[1:]), [r["mismatch_abs_logp"] for r in rows]


@pytest.mark.slow
def test_checkpoints_hold_adapters_and_the_bases_identity_only(lora_run, cache_env):
    cfg, workdir, _ = lora_run
    cache_dir = cache_env["JAXRL_CACHE_DIR"]
    step_dir = workdir / "checkpoints" / str(STEPS)
    saved = ocp.StandardCheckpointHandler().metadata(step_dir / "state")
    assert saved.get("base") is None and saved.get("ref_params") is None
    leaves = jax.tree_util.tree_flatten_with_path(saved["params"])[0]
    assert leaves and all(p[-1].key in ("a", "b") for p, _ in leaves)  # adapters, no base weight
    assert all(cfg.model.lora.rank in m.shape for _, m in leaves)
    host = json.loads((step_dir / "host" / "metadata").read_text())
    # the base: the warm-start cache's entry for this config, as for full fine-tuning
    assert pathlib.Path(host["lora"]["base_path"]).parent == pathlib.Path(cache_dir)
    assert all(math.isfinite(x) for x in host["lora"]["fingerprint"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "source",
    [
        ["rollout.engine.enabled=true", "rollout.engine.slots=8", "rollout.engine.admission=fill"],
        # Every rollout speculates (probe_every=1; no cost timing, the configured constants), and at
        # this train.seed the adaptive control drafts on both steps: step 2's drafts come from the updated
        # adapters' int8 view, which is what this case is for.
        [
            "rollout.speculative.enabled=true",
            "rollout.speculative.drafter=int8",
            "rollout.speculative.probe_every=1",
            "rollout.speculative.calibrate=false",
            "train.seed=4",
            "warmstart.seed=0",  # the base policy the other runs here use (a cached warm start)
        ],
    ],
    ids=["engine", "speculative_int8"],
)
def test_the_engine_and_the_speculative_sampler_roll_out_the_merged_policy(
    source, tmp_path, in_process_cache, persistent_compile_cache
):
    # Two steps, but lora_run's learning-rate schedule (decay over its 3 steps) and KL term: the
    # speculative run's update is lora_run's program, compiled once through the persistent cache (the
    # engine's batch has its own layout, so its update is its own program either way).
    extra = [f"optim.decay_steps={STEPS}", "train.steps=2", "checkpoint.every=0"]
    cfg = load_config(DEFAULT_CONFIG, [*OVERRIDES, *extra, *source])
    rows = loop.train(cfg, tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["grad_norm"] > 0 for r in rows[1:])  # the adapters moved before step 2 sampled
    assert all(r["mismatch_abs_logp"] < 1e-5 for r in rows[1:]), [r["mismatch_abs_logp"] for r in rows[1:]]
    if cfg.rollout.speculative.enabled:  # the speculative sampler really drafted, after the update too
        assert all(r["spec/speculated_frac"] > 0 for r in rows[1:]), [r.get("spec/speculated_frac") for r in rows]


def _copy_without_newest(workdir: pathlib.Path, copy: pathlib.Path) -> pathlib.Path:
    shutil.copytree(workdir, copy)
    shutil.rmtree(copy / "checkpoints" / str(STEPS))
    return copy


@pytest.mark.slow
def test_a_resumed_lora_run_matches_the_uninterrupted_one(lora_run, tmp_path, in_process_cache):
    cfg, workdir, straight = lora_run
    resumed = {r["step"]: r for r in loop.train(cfg, _copy_without_newest(workdir, tmp_path / "resumed"))}
    assert sorted(resumed) == list(range(STEPS + 1))
    for row in straight[3:]:
        for key in DETERMINISTIC:
            assert resumed[row["step"]].get(key) == row.get(key), (row["step"], key)


@pytest.mark.slow
def test_a_resume_on_another_base_is_refused(lora_run, tmp_path, in_process_cache):
    cfg, workdir, _ = lora_run
    copy = _copy_without_newest(workdir, tmp_path / "other")
    host_file = copy / "checkpoints" / "2" / "host" / "metadata"
    host = json.loads(host_file.read_text())
    host["lora"]["fingerprint"][0] += 1.0  # as if trained on another base
    host["lora"]["base_path"] = "/elsewhere/base"
    host_file.write_text(json.dumps(host))
    with pytest.raises(ConfigError, match=r"checkpoint 2 in .*'/elsewhere/base'.* different weights"):
        loop.train(cfg, copy)
    assert (copy / "checkpoints" / "2").is_dir()  # nothing saved is lost


def test_checkpoints_keep_the_format_from_before_the_base_field(tmp_path):
    """A checkpoint written before TrainState had `base` (a 5-field tree) restores into today's saved
    part, and today's saved part is that same tree: runs resume across the change both ways."""
    from typing import Any, NamedTuple

    from jaxrl.config import CheckpointConfig
    from jaxrl.train import checkpoint as ckpt
    from jaxrl.train.state import TrainState, saved_part

    class OldTrainState(NamedTuple):
        step: Any
        params: Any
        opt_state: Any
        rng: Any
        ref_params: Any = None

    manager = ckpt.make_manager(tmp_path, CheckpointConfig(every=1, keep=3, async_save=False))
    old = OldTrainState(jnp.ones((), jnp.int32), {"w": jnp.ones(3)}, (), jnp.zeros((2,), jnp.uint32))
    ckpt.save(manager, 1, old, {"stream": {}}, force=True)
    manager.wait_until_finished()
    now = TrainState(jnp.zeros((), jnp.int32), {"w": jnp.zeros(3)}, (), jnp.zeros((2,), jnp.uint32), base={"x": 1.0})
    step, restored, _ = ckpt.restore_latest(manager, ckpt.abstract_like(saved_part(now)))
    assert step == 1 and int(restored.step) == 1 and float(restored.params["w"][0]) == 1.0
    manager.close()


def _policy_and_one_update(preset: str) -> dict[str, np.ndarray]:
    """On a `preset` mesh: the LoRA policy at initialisation and the adapters and metrics after one
    update (KL term on), flattened into named host arrays; and whether the built state splits its
    first adapter and base leaves over devices (`split/...`)."""
    from jax.sharding import PartitionSpec

    mesh_cfg = MeshConfig(preset=preset)
    state = build(DENSE, LORA, mesh_cfg)[2]
    out = {
        f"split/{i}": np.asarray(isinstance(s := x.sharding.spec, PartitionSpec) and any(ax is not None for ax in s))
        for i, x in enumerate((jax.tree.leaves(state.params)[0], jax.tree.leaves(state.base)[0]))
    }
    policy = jitted_policy(DENSE, LORA, mesh_cfg)(state)
    new, metrics = jitted_update(DENSE, LORA, mesh_cfg)(state, batch())
    for name, tree in (("policy", policy), ("adapters", new.params), ("metrics", metrics)):
        out.update({f"{name}/{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(tree))})
    return out


def _sharded_worker(out_file: str) -> None:
    """In a child with 8 fake devices: `_policy_and_one_update("fsdp")`, saved to `out_file` (.npz)."""
    np.savez(out_file, **_policy_and_one_update("fsdp"))


@pytest.mark.slow
def test_fsdp_on_8_devices_equals_one_device(cache_env, tmp_path):
    """The fsdp preset over 8 devices (in a child) against this process's single device: the same
    policy, update and metrics. Only the sharded run needs the 8 devices' child."""
    out_file = tmp_path / "fsdp.npz"
    run_python([__file__, "worker", str(out_file)], child_env(cache_env, devices=8))
    fsdp, single = dict(np.load(out_file)), _policy_and_one_update("single")
    assert fsdp.keys() == single.keys()
    assert [bool(fsdp["split/0"]), bool(fsdp["split/1"])] == [True, True]  # adapters and base both sharded
    assert [bool(single["split/0"]), bool(single["split/1"])] == [False, False]
    for name in (k for k in fsdp if not k.startswith("split/")):
        np.testing.assert_allclose(fsdp[name], single[name], rtol=0, atol=1e-5, err_msg=name)
    assert max(float(np.max(np.abs(x))) for k, x in single.items() if k.startswith("adapters/")) > 0


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _sharded_worker(sys.argv[2])
