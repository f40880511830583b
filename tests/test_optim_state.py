"""optim.state_dtype=bfloat16: AdamW's two moments stored in bfloat16, half the optimizer state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import DEFAULT_CONFIG, TINY

from jaxrl.config import CheckpointConfig, ConfigError, OptimConfig, load_config
from jaxrl.config.errors import WorkdirError
from jaxrl.train import checkpoint as ckpt
from jaxrl.train import loop
from jaxrl.train.state import init_state, make_optimizer, opt_state_in, saved_part

# Orbax leaves the cancelled reads of a failed restore as never-awaited coroutines: noise, not a fault.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _params(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"w_DxF": 0.3 * jax.random.normal(k1, (64, 32)), "b_F": 0.1 * jax.random.normal(k2, (32,))}


def _adam(state_dtype, **kw):
    return make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=0, state_dtype=state_dtype, **kw), 100)


def _moments(opt_state):
    adam = opt_state[1][0]  # chain(clip, adamw) -> adamw's chain -> scale_by_adam's state
    return adam.mu, adam.nu


def _nbytes(tree) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def test_moment_dtypes_and_the_state_halves():
    params = _params()
    n_params = sum(x.size for x in jax.tree.leaves(params))
    states = {
        dt: jax.eval_shape(lambda p, dt=dt: init_state(p, _adam(dt), jax.random.key(0)), params)
        for dt in ("float32", "bfloat16")
    }
    for dt, state in states.items():
        assert {x.dtype for x in jax.tree.leaves(_moments(state.opt_state))} == {jnp.dtype(dt)}
        assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype("float32")}  # master weights stay
    # The same tree (a checkpoint of one restores into the other), half the moment bytes.
    f32, bf16 = states["float32"].opt_state, states["bfloat16"].opt_state
    assert jax.tree.structure(f32) == jax.tree.structure(bf16)
    assert _nbytes(_moments(f32)) == 8 * n_params and _nbytes(_moments(bf16)) == 4 * n_params
    counts = 2 * 4  # two int32 step counts (Adam's, the schedule's), the rest is moments
    assert _nbytes(f32) - counts == 2 * (_nbytes(bf16) - counts) == 8 * n_params


def test_compiled_update_holds_half_the_moments():
    # XLA's own account: the compiled update's arguments and outputs shrink by the 4 bytes per parameter
    # that bfloat16 moments save, and the stored moments are bf16 in the program.
    params = _params()
    n_params = sum(x.size for x in jax.tree.leaves(params))
    sizes, texts = {}, {}
    for dt in ("float32", "bfloat16"):
        opt = _adam(dt)

        def step(params, opt_state, grads, opt=opt):
            updates, opt_state = opt.update(grads, opt_state, params)
            return jax.tree.map(jnp.add, params, updates), opt_state

        compiled = jax.jit(step).lower(params, opt.init(params), params).compile()
        mem = compiled.memory_analysis()
        assert mem is not None
        sizes[dt] = (mem.argument_size_in_bytes, mem.output_size_in_bytes)
        texts[dt] = compiled.as_text()
    assert sizes["float32"][0] - sizes["bfloat16"][0] == 4 * n_params, sizes
    assert sizes["float32"][1] - sizes["bfloat16"][1] == 4 * n_params, sizes
    assert "bf16[64,32]" in texts["bfloat16"] and "bf16[64,32]" not in texts["float32"]


def test_training_with_bfloat16_moments_is_finite_and_follows_float32():
    # 50 AdamW steps of least squares from the same start: bfloat16 moments move the weights as float32's do.
    params0 = _params()
    x_NxD = jax.random.normal(jax.random.key(1), (128, 64))
    y_NxF = jnp.tanh(x_NxD @ _params(2)["w_DxF"])

    def loss(p):
        return jnp.mean((x_NxD @ p["w_DxF"] + p["b_F"] - y_NxF) ** 2)

    def run(dt):
        opt = _adam(dt, weight_decay=0.01)

        @jax.jit
        def step(carry, _):
            p, s = carry
            updates, s = opt.update(jax.grad(loss)(p), s, p)
            return (jax.tree.map(jnp.add, p, updates), s), loss(p)

        (params, state), losses = jax.lax.scan(step, (params0, opt.init(params0)), length=50)
        return params, state, losses

    p32, _, l32 = run("float32")
    p16, s16, l16 = run("bfloat16")
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves((p16, s16, l16)))
    assert float(l16[-1]) < 0.5 * float(l16[0])  # it trains
    np.testing.assert_allclose(np.asarray(l16), np.asarray(l32), rtol=2e-2)
    for k in params0:
        moved = float(jnp.max(jnp.abs(p32[k] - params0[k])))
        assert float(jnp.max(jnp.abs(p16[k] - p32[k]))) <= 0.02 * moved, k
    assert not all(bool(jnp.array_equal(p16[k], p32[k])) for k in params0)  # the option does change the run


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="optim.state_dtype"):
        load_config(DEFAULT_CONFIG, ["optim.state_dtype=float16"])
    with pytest.raises(ConfigError, match="optim.state_memory"):
        load_config(DEFAULT_CONFIG, ["optim.state_memory=unpinned_host"])
    # b2 = 0.999: 1 - b2 is under bfloat16's half-step, so a bfloat16 nu would never decay.
    with pytest.raises(ConfigError, match=r"optim.b2.*state_dtype='bfloat16'"):
        load_config(DEFAULT_CONFIG, ["optim.state_dtype=bfloat16", "optim.b2=0.999"])
    assert load_config(DEFAULT_CONFIG, ["optim.state_dtype=bfloat16"]).optim.state_dtype == "bfloat16"
    assert load_config(DEFAULT_CONFIG, ["optim.b2=0.999"]).optim.b2 == 0.999  # float32 moments: any b2


@pytest.mark.parametrize(("saved", "resumed"), [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_checkpoint_restores_into_the_other_dtype_by_casting(tmp_path, saved, resumed):
    # The documented cast: the trees match, Orbax casts each moment to the dtype the run now asks for.
    params = _params()
    opt = _adam(saved)
    state = init_state(params, opt, jax.random.key(0))
    grads = jax.tree.map(lambda x: 1e-3 * x + 1e-20, params)
    _, opt_state = opt.update(grads, state.opt_state, params)
    state = state._replace(opt_state=opt_state, step=jnp.asarray(1, jnp.int32))
    manager = ckpt.make_manager(tmp_path, CheckpointConfig(async_save=False))
    ckpt.save(manager, 1, saved_part(state), {"stream": {"epoch": 0, "index": 1}}, force=True)
    manager.wait_until_finished()
    target = saved_part(init_state(params, _adam(resumed), jax.random.key(0)))
    result = ckpt.restore_latest(manager, ckpt.abstract_like(target))
    assert result is not None
    step, restored, _ = result
    assert step == 1
    for got, want in zip(jax.tree.leaves(_moments(restored.opt_state)), jax.tree.leaves(_moments(opt_state))):
        assert got.dtype == jnp.dtype(resumed)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(resumed)))


@pytest.mark.slow
def test_run_resumed_with_another_state_dtype_needs_the_flag(tmp_path, in_process_cache):
    base = [t for t in TINY if not t.startswith("train.eval_")] + ["train.eval_every=0", "train.eval_prompts=2"]
    rows = loop.train(load_config(DEFAULT_CONFIG, [*base, "train.steps=1", "checkpoint.every=1"]), tmp_path)
    assert rows[-1]["step"] == 1
    bf16 = load_config(DEFAULT_CONFIG, [*base, "train.steps=2", "checkpoint.every=1", "optim.state_dtype=bfloat16"])
    with pytest.raises(WorkdirError, match="optim.state_dtype"):
        loop.train(bf16, tmp_path)
    rows = loop.train(bf16, tmp_path, allow_config_change=True)  # the moments are cast on restore
    assert rows[-1]["step"] == 2 and np.isfinite(rows[-1]["loss"])


def _has_pinned_host() -> bool:
    return any(m.kind == "pinned_host" for m in jax.devices()[0].addressable_memories())


@pytest.mark.skipif(not _has_pinned_host(), reason="this backend has no pinned_host memory")
def test_host_offloaded_state_is_in_host_memory_and_updates_alike():
    # optim.state_memory=pinned_host: the compiled update takes and returns the optimizer state in host
    # memory (XLA's memory space S(5) in the entry layout), moves it to the device for the AdamW step
    # and back, and computes exactly what the device-resident update does.
    mesh = jax.make_mesh((1,), ("data",))
    device_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params = jax.device_put(_params(), device_sh)
    grads = jax.tree.map(lambda x: 0.1 * x, params)
    results = {}
    for memory in ("device", "pinned_host"):
        opt = make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=0, state_memory=memory), 100)
        state = init_state(params, opt, jax.random.key(0))
        state_sh = opt_state_in(jax.tree.map(lambda _: device_sh, state), memory)
        state = jax.device_put(state, state_sh)
        assert {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)} == {memory}
        assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"device"}

        def step(state, grads, opt=opt):
            updates, opt_state = opt.update(grads, state.opt_state, state.params)
            return state._replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state)

        jitted = jax.jit(step, in_shardings=(state_sh, device_sh), out_shardings=state_sh)
        text = jitted.lower(state, grads).compile().as_text()
        assert text is not None
        layout = text.split("entry_computation_layout=")[1].split("\n")[0]
        for _ in range(3):
            state = jitted(state, grads)
        assert {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)} == {memory}
        results[memory] = (state, layout)
    # Host memory: the two moments' 2 x 2 arrays in S(5), on the way in and on the way out.
    assert results["device"][1].count("S(5)") == 0
    assert results["pinned_host"][1].count("S(5)") >= 2 * 2 * 2, results["pinned_host"][1]
    (dev, _), (host, _) = results["device"], results["pinned_host"]
    for a, b in zip(jax.tree.leaves((dev.params, dev.opt_state)), jax.tree.leaves((host.params, host.opt_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
@pytest.mark.skipif(not _has_pinned_host(), reason="this backend has no pinned_host memory")
def test_run_with_host_offloaded_state_matches_and_resumes(tmp_path, in_process_cache):
    base = [t for t in TINY if not t.startswith("train.eval_")] + [
        "train.eval_every=0",
        "train.eval_prompts=2",
        "checkpoint.every=1",
        "train.minibatches=2",
    ]
    timing = {"rollout/tokens_per_s", "rollout/seconds", "step_seconds", "wall_time"}

    def untimed(rows):
        return [{k: v for k, v in r.items() if k not in timing} for r in rows]

    # The wiring (the state placed in host memory, the update's jit, checkpoints saved from and restored
    # into host memory); the update's numbers with non-zero gradients are the test above's.
    on_device = loop.train(load_config(DEFAULT_CONFIG, [*base, "train.steps=2"]), tmp_path / "device")
    host = [*base, "optim.state_memory=pinned_host"]
    on_host = loop.train(load_config(DEFAULT_CONFIG, [*host, "train.steps=2"]), tmp_path / "host")
    assert untimed(on_host) == untimed(on_device)  # the same numbers, the state kept in host memory
    resumed = loop.train(load_config(DEFAULT_CONFIG, [*host, "train.steps=3"]), tmp_path / "host", True)
    assert resumed[-1]["step"] == 3 and np.isfinite(resumed[-1]["loss"])  # restored into host memory
