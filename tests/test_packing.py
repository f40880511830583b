"""Packed updates (`train.packing`, jaxrl.models.packing): the live tokens of a padded batch packed into
N sequences of L slots with per-row segments and positions. The plan by hand on a small batch; the
packed forward equals the padded one at every live token (both attention kernels XLA:CPU runs); the
update (loss, metrics, gradients through SGD) equals the padded update for several presets, with
microbatches, mini-batches and a reference forward; rows that do not fit run padded; the compiled
packed forward does less work; a tiny `jaxrl train` with packing on."""

import dataclasses
import functools
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import DEFAULT_CONFIG, TINY, jaxrl_cmd

from jaxrl import losses
from jaxrl.config import ConfigError, ModelConfig, load_config
from jaxrl.config.train import PACKING as CONFIG_PACKING
from jaxrl.models.attention import allowed_slots, attend_slots, attend_slots_fused
from jaxrl.models.cache_kinds import SegmentIds
from jaxrl.models.packing import PACKING, PackSpec, packed_token_logprobs, plan_packs
from jaxrl.models.splash import attend_slots_splash
from jaxrl.models.transformer import init_params, token_logprobs
from jaxrl.train import steps as steps_lib
from jaxrl.train.state import init_state

V = 29
CFG = ModelConfig(vocab_size=V, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, mlp_dim=32, max_seq_len=16)


def _hand_batch():
    """4 rows, P = 3, T = 4; token (b, s) of the padded [prompt | completion] row is 100 + 10 b + s."""
    tokens_BxS = 100 + 10 * np.arange(4)[:, None] + np.arange(7)[None, :]
    prompt_mask = np.array([[0, 1, 1], [1, 1, 1], [0, 0, 1], [0, 1, 1]])
    completion_mask = np.array(
        [
            [1, 1, 0, 0],  # 2 real prompt tokens + 2: 4 slots
            [1, 1, 1, 1],  # 3 + 4: 7
            [0, 0, 0, 0],  # no live completion token: packs nothing
            [1, 0, 1, 0],  # a masked token before the last live one stays (context): 2 + 3 = 5
        ],
        np.float32,
    )
    return tokens_BxS[:, :3], tokens_BxS[:, 3:], prompt_mask, completion_mask


def test_plan_places_every_live_token_once_with_restarting_positions_and_segments():
    prompt, tokens, pmask, cmask = _hand_batch()
    plan = plan_packs(jnp.asarray(pmask), jnp.asarray(cmask), n_packs=2, pack_len=9)
    # First-fit-decreasing: row 1 (7) -> pack 0; row 3 (5) -> pack 1 (pack 0 has 2 left); row 0 (4) -> pack 1.
    assert bool(plan.fits)
    seg = np.asarray(plan.segment_NL).reshape(2, 9)
    np.testing.assert_array_equal(seg, [[2] * 7 + [0, 0], [4] * 5 + [1] * 4])
    pos = np.asarray(plan.position_NL).reshape(2, 9)
    np.testing.assert_array_equal(pos, [[0, 1, 2, 3, 4, 5, 6, 0, 0], [0, 1, 2, 3, 4, 0, 1, 2, 3]])
    flat_BS = np.concatenate([prompt, tokens], axis=1).reshape(-1)
    source = np.asarray(plan.source_NL)
    placed = np.where(source < flat_BS.size, flat_BS[np.minimum(source, flat_BS.size - 1)], 0).reshape(2, 9)
    np.testing.assert_array_equal(
        placed, [[110, 111, 112, 113, 114, 115, 116, 0, 0], [131, 132, 133, 134, 135, 101, 102, 103, 104]]
    )
    # Every live token exactly once, nothing else: the slots of the live tokens are distinct and in range.
    slot = np.asarray(plan.slot_BxS)
    extent = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [0] * 4, [1, 1, 1, 0]], bool)
    live = np.concatenate([pmask > 0, extent], axis=1)
    live[2] = False
    assert sorted(slot[live].tolist()) == np.flatnonzero(seg.reshape(-1) > 0).tolist()  # each once, all of them
    assert (slot[~live] == 18).all()
    # The attention mask: causal within a segment, nothing across segments or onto empty slots.
    allowed = np.asarray(allowed_slots(SegmentIds(jnp.asarray(seg)), 0, 9, 9))
    want = np.zeros((2, 9, 9), bool)
    for n, blocks in ((0, [(0, 7)]), (1, [(0, 5), (5, 9)])):
        for a, b in blocks:
            want[n, a:b, a:b] = np.tril(np.ones((b - a, b - a), bool))
    np.testing.assert_array_equal(allowed, want)


def test_rows_that_do_not_fit_are_reported():
    _, _, pmask, cmask = _hand_batch()
    assert not bool(plan_packs(jnp.asarray(pmask), jnp.asarray(cmask), n_packs=1, pack_len=9).fits)
    assert not bool(plan_packs(jnp.asarray(pmask), jnp.asarray(cmask), n_packs=4, pack_len=6).fits)  # row 1: 7


def _ragged(B=8, P=4, T=6, seed=0):
    rng = np.random.default_rng(seed)
    plen = rng.integers(1, P + 1, B)
    clen = rng.integers(0, T + 1, B)
    clen[0] = T
    pmask = (np.arange(P)[None] >= P - plen[:, None]).astype(np.int32)
    cmask = (np.arange(T)[None] < clen[:, None]).astype(np.float32)
    cmask[1, 0] = 0.0  # a masked context token inside a row
    return {
        "prompt_tokens_BxP": jnp.asarray(rng.integers(3, V, (B, P)) * pmask, jnp.int32),
        "prompt_mask_BxP": jnp.asarray(pmask),
        "tokens_BxT": jnp.asarray(rng.integers(3, V, (B, T)), jnp.int32),
        "completion_mask_BxT": jnp.asarray(cmask),
    }, np.arange(T)[None] < clen[:, None]


@pytest.mark.parametrize("kernel", ["cpu", "xla"])
def test_packed_forward_equals_padded_at_live_tokens(kernel):
    cfg = dataclasses.replace(CFG, attention=kernel)
    params = init_params(cfg, jax.random.key(0))
    batch, live = _ragged(seed=1)
    keys = ("prompt_tokens_BxP", "prompt_mask_BxP", "tokens_BxT", "completion_mask_BxT")
    want = token_logprobs(params, cfg, *(batch[k] for k in keys), 1.3)
    for chunk in (0, 5):
        plan = plan_packs(batch["prompt_mask_BxP"], batch["completion_mask_BxT"], n_packs=6, pack_len=10)
        assert bool(plan.fits) and int(jnp.sum(plan.segment_NL > 0)) > 40  # 8 rows share 6 packs
        got = packed_token_logprobs(
            params,
            cfg,
            batch["prompt_tokens_BxP"],
            batch["tokens_BxT"],
            plan,
            1.3,
            n_packs=6,
            pack_len=10,
            logits_chunk=chunk,
        )
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.where(live, g, 0.0), np.where(live, w, 0.0), atol=2e-6)
            assert (np.asarray(g)[~live] == 0).all()


@pytest.mark.parametrize("kernel", ["xla", "splash"])
def test_fused_kernels_take_segment_ids_as_the_einsum_form(kernel):
    """`xla` through its mask, `splash` (Pallas' interpreter on CPU) through its own segment ids."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((2, 6, 4, 8), (2, 6, 2, 8), (2, 6, 2, 8)))
    seg = SegmentIds(jnp.asarray([[1, 1, 2, 2, 2, 0], [3, 3, 3, 3, 1, 1]], jnp.int32))
    want = attend_slots(q, k, v, seg, 0, jnp.float32)
    if kernel == "xla":
        got = attend_slots_fused(q, k, v, seg, 0, jnp.float32, "xla")
    else:
        got = attend_slots_splash(q, k, v, seg, 0, jnp.float32, interpret=True)
    valid = np.asarray(seg.ids_BxS) > 0
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=1e-5)


B, P, T, G = 8, 4, 6, 2


def _update_batch():
    batch, _ = _ragged(B, P, T, seed=3)
    for key in ("prompt_tokens_BxP", "prompt_mask_BxP"):  # groups of G rows share one prompt
        batch[key] = jnp.repeat(batch[key][::G], G, axis=0)
    rewards = jnp.asarray([[1.0], [0.0], [0.0], [1.0], [1.0], [0.0], [0.5], [0.0]])
    return dict(batch, rewards_BxK=rewards, truncated_B=jnp.zeros((B,), jnp.float32))


@functools.cache
def _update(preset: str, packing: PackSpec | None, minibatches: int, microbatches: int):
    loss = losses.PRESETS[preset](kl_beta=0.04) if preset == "grpo" else losses.PRESETS[preset]()
    logp_fn = steps_lib.make_logp_fn(CFG, 1.0, prompt_groups=G, packing=packing)
    step = steps_lib.make_update_step(
        logp_fn,
        loss,
        optax.sgd(1.0),  # SGD: the params' change is the gradient itself
        ppo_epochs=1,
        minibatches=minibatches,
        microbatches=microbatches,
        max_new_tokens=T,
        group_size=G,
    )
    return jax.jit(step)


def _state():
    params = init_params(CFG, jax.random.key(0))
    return init_state(params, optax.sgd(1.0), jax.random.key(1), ref_params=jax.tree.map(lambda x: x * 0.9, params))


@pytest.mark.parametrize(
    "preset,minibatches,microbatches", [("grpo", 1, 1), ("grpo", 2, 2), ("dapo", 1, 2), ("cispo", 1, 1)]
)
def test_packed_update_equals_padded(preset, minibatches, microbatches):
    batch = _update_batch()
    padded_state, padded = _update(preset, None, minibatches, microbatches)(_state(), batch)
    spec = PackSpec("on", 0, 0.7)
    packed_state, packed = _update(preset, spec, minibatches, microbatches)(_state(), batch)
    assert float(packed["packing/fallback"]) == 0.0 and 0.0 < float(packed["packing/fill"]) <= 1.0
    for key, value in padded.items():
        np.testing.assert_allclose(packed[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    leaves = (jax.tree.leaves(s.params) for s in (packed_state, padded_state, _state()))
    for after_packed, after_padded, start in zip(*leaves):
        grad_packed, grad_padded = np.asarray(start - after_packed), np.asarray(start - after_padded)
        assert np.abs(grad_padded).max() > 0
        np.testing.assert_allclose(grad_packed, grad_padded, rtol=1e-4, atol=1e-5 * np.abs(grad_padded).max())


def test_rows_that_do_not_fit_run_padded_with_the_same_numbers():
    batch = _update_batch()
    _, padded = _update("grpo", None, 1, 1)(_state(), batch)
    _, tight = _update("grpo", PackSpec("on", 0, 0.05), 1, 1)(_state(), batch)  # one pack of 10 slots
    assert float(tight["packing/fallback"]) == 1.0
    np.testing.assert_allclose(tight["loss"], padded["loss"], rtol=1e-6)


def test_several_pack_counts_run_the_smallest_that_fits():
    batch = _update_batch()  # 36 live tokens of 80 padded slots
    _, padded = _update("grpo", None, 1, 1)(_state(), batch)
    _, one = _update("grpo", PackSpec("on", 0, 0.9), 1, 1)(_state(), batch)  # 8 packs of 10
    _, three = _update("grpo", PackSpec("on", 0, 0.9, sizes=3), 1, 1)(_state(), batch)  # 3, 5 or 8 packs
    assert float(one["packing/fill"]) == pytest.approx(36 / 80) and float(three["packing/fill"]) == pytest.approx(
        36 / 50
    )
    for got in (one, three):
        assert float(got["packing/fallback"]) == 0.0
        np.testing.assert_allclose(got["loss"], padded["loss"], rtol=1e-5)
        np.testing.assert_allclose(got["grad_norm"], padded["grad_norm"], rtol=1e-5)


def test_auto_keeps_the_shared_prefix_forward_where_the_prompt_is_wide():
    assert PackSpec("auto").use(shared=True, prompt_len=8, completion_len=4) is False
    assert PackSpec("auto").use(shared=True, prompt_len=4, completion_len=8) is True
    assert PackSpec("auto").use(shared=False, prompt_len=8, completion_len=4) is True
    assert PackSpec("on").use(shared=True, prompt_len=8, completion_len=4) is True


def _flops(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    assert cost is not None
    return cost["flops"]


def test_compiled_packed_forward_does_about_the_budgeted_work():
    """Packs holding half the padded slots (budget 0.5): the compiled packed forward's FLOPs are about
    half the padded one's (the plan's gathers, scatters and first-fit scan are small beside the
    layers); the update's logp function holds both behind one conditional."""
    cfg = dataclasses.replace(CFG, d_model=64, head_dim=32, mlp_dim=256)
    params = init_params(cfg, jax.random.key(0))
    batch, _ = _ragged(16, 4, 28, seed=2)
    (n_packs,), pack_len = PackSpec("on", 0, 0.5).counts(16, 32)
    assert (n_packs, pack_len) == (8, 32)
    assert PackSpec("on", 0, 0.5, sizes=4).counts(16, 32) == ((2, 4, 6, 8), 32)

    def packed(p, b):
        plan = plan_packs(b["prompt_mask_BxP"], b["completion_mask_BxT"], n_packs=n_packs, pack_len=pack_len)
        args = (b["prompt_tokens_BxP"], b["tokens_BxT"], plan, 1.0)
        return packed_token_logprobs(p, cfg, *args, n_packs=n_packs, pack_len=pack_len)

    keys = ("prompt_tokens_BxP", "prompt_mask_BxP", "tokens_BxT", "completion_mask_BxT")
    padded_flops = _flops(lambda p, b: token_logprobs(p, cfg, *(b[k] for k in keys), 1.0), params, batch)
    packed_flops = _flops(packed, params, batch)
    assert 0.45 * padded_flops < packed_flops < 0.55 * padded_flops
    logp_fn = steps_lib.make_logp_fn(cfg, 1.0, packing=PackSpec("on", 0, 0.5))
    hlo = jax.jit(lambda p, b: logp_fn(p, b)[:2]).lower(params, batch).compile().as_text()
    assert hlo is not None and "conditional(" in hlo


def test_the_update_keeps_one_arms_activations():
    """The fallback's cond sits outside each arm's gradient (`packed_steps.value_and_grad_of`): the
    compiled packed update holds no more temporaries than the padded one (the larger arm's).
    Differentiating through the cond (the PackedLogp called as a plain function) keeps both arms'
    residuals: more."""
    cfg = dataclasses.replace(CFG, d_model=64, head_dim=32, mlp_dim=256, max_seq_len=64)
    batch, _ = _ragged(16, 4, 28, seed=2)
    batch = dict(batch, rewards_BxK=jnp.zeros((16, 1)), truncated_B=jnp.zeros((16,)))
    state = init_state(init_params(cfg, jax.random.key(0)), optax.sgd(1.0), jax.random.key(1))

    def temp_mib(logp_fn):
        step = steps_lib.make_update_step(
            logp_fn,
            losses.PRESETS["grpo"](),
            optax.sgd(1.0),
            ppo_epochs=1,
            microbatches=1,
            max_new_tokens=28,
            group_size=2,
        )
        memory = jax.jit(step).lower(state, batch).compile().memory_analysis()
        assert memory is not None
        return memory.temp_size_in_bytes / 2**20

    packed_fn = steps_lib.make_logp_fn(cfg, 1.0, packing=PackSpec("on", 0, 0.5))
    padded = temp_mib(steps_lib.make_logp_fn(cfg, 1.0))
    packed = temp_mib(packed_fn)
    through_cond = temp_mib(lambda p, b: packed_fn(p, b))
    assert packed < 1.05 * padded < through_cond, (packed, padded, through_cond)


def test_packing_config_fields():
    assert CONFIG_PACKING == PACKING
    with pytest.raises(ConfigError, match="train.packing"):
        load_config(DEFAULT_CONFIG, [*TINY, "train.packing=yes"])
    with pytest.raises(ConfigError, match="train.pack_budget"):
        load_config(DEFAULT_CONFIG, [*TINY, "train.pack_budget=0"])
    with pytest.raises(ConfigError, match="train.packing"):
        load_config(DEFAULT_CONFIG, [*TINY, "train.packing=on", "model.n_experts=4"])


@pytest.mark.slow
def test_train_with_packing_on(tmp_path, cache_env):
    workdir = tmp_path / "run"
    # The tiny untrained policy writes to max_new_tokens (~90% live slots): a budget of 1 always fits.
    sets = [*TINY, "train.steps=2", "train.packing=on", "train.pack_budget=1", "train.pack_sizes=2"]
    cmd = jaxrl_cmd("train", str(DEFAULT_CONFIG), "--workdir", str(workdir), *[a for s in sets for a in ("--set", s)])
    subprocess.run(cmd, env=cache_env, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "loss" in r]
    assert [r["step"] for r in trained] == [1, 2]
    for r in trained:
        assert np.isfinite(r["loss"]) and 0.0 < r["packing/fill"] <= 1.0 and r["packing/fallback"] == 0.0


@pytest.mark.slow
def test_packed_update_benchmark_small(capsys):
    """benchmarks/packed_update.py --small: both workloads ran both ways; nothing to pack in uniform."""
    from harness import run_benchmark_here

    # one pack count at 0.9 of the slots: one packed arm to compile, and the long-tail rows fit it
    result = run_benchmark_here("packed_update.py", "--small", "--sizes", "1", "--budget", "0.9", capsys=capsys)
    assert set(result["packed_speedup"]) == {"longtail", "uniform"}
    assert result["uniform"]["fallback"] == 1.0 and result["longtail"]["fallback"] < 1.0
    assert 0.2 < result["longtail"]["live_share_of_padded_slots"] < 0.8
    assert result["longtail"]["packed_tokens_per_s"] > 0 and result["longtail"]["padded_tokens_per_s"] > 0


def _worker() -> None:
    """8 fake devices, `data` and `fsdp` meshes: the packed update (grpo, 2 microbatches) gives one
    device's loss and gradient norm; the packed arm's forward and backward (compiled alone: a
    switch's cost analysis counts its largest arm, the padded one) runs 1/8 of one device's FLOPs per
    device (the packs split over the batch devices; N is a multiple of them)."""
    from jaxrl.config import MeshConfig
    from jaxrl.models.transformer import param_logical_axes
    from jaxrl.sharding import make_mesh, named_shardings, parallel_for, param_shardings, replicated
    from jaxrl.train.packed_steps import PackedLogp
    from jaxrl.train.state import state_shardings

    assert jax.device_count() == 8, jax.devices()
    cfg = dataclasses.replace(CFG, d_model=64, head_dim=32, mlp_dim=256, max_seq_len=64)
    rows = 64  # x 32 slots; 0.75 of them: 48 packs (24 per microbatch), a multiple of 8
    batch, _ = _ragged(rows, 4, 28, seed=5)
    rewards = jnp.asarray(np.arange(rows) % 3, jnp.float32)[:, None]
    batch = dict(batch, rewards_BxK=rewards, truncated_B=jnp.zeros((rows,)))
    optimizer = optax.sgd(1.0)
    params = init_params(cfg, jax.random.key(0))
    out = {}
    for name in ("single", "data", "fsdp"):
        mesh, preset = make_mesh(MeshConfig(preset=name), jax.devices()[: 1 if name == "single" else 8])
        parallel = parallel_for(mesh, preset)
        param_sh = param_shardings(mesh, preset, param_logical_axes(cfg), params)
        rep = replicated(mesh)
        state = init_state(params, optimizer, jax.random.key(1))
        state_sh = state_shardings(optimizer, state, param_sh, rep)
        logp_fn = steps_lib.make_logp_fn(cfg, 1.0, parallel=parallel, packing=PackSpec("on", 0, 0.75))
        assert isinstance(logp_fn, PackedLogp)
        step = steps_lib.make_update_step(
            logp_fn,
            losses.PRESETS["grpo"](),
            optimizer,
            ppo_epochs=1,
            microbatches=2,
            max_new_tokens=28,
            group_size=2,
            parallel=parallel,
        )
        batch_sh = named_shardings(mesh, preset, batch)
        jitted = jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, rep))
        _, metrics = jitted(jax.device_put(state, state_sh), jax.device_put(batch, batch_sh))
        out[name] = {k: float(metrics[k]) for k in ("loss", "grad_norm", "packing/fallback")}

        def packed_grad(p, b, logp_fn=logp_fn):
            return jax.grad(lambda p: jnp.sum(logp_fn.arms(b)[0](p, b)[0] * b["completion_mask_BxT"]))(p)

        program = jax.jit(packed_grad, in_shardings=(param_sh, batch_sh)).lower(params, batch).compile()
        cost = program.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        assert cost is not None
        out[name]["flops"] = cost["flops"]
    print("RESULT " + json.dumps(out))


@pytest.mark.slow
def test_packed_update_splits_over_devices(cache_env):
    from harness import worker_result

    got = worker_result(__file__, cache_env, timeout=600)[0]
    one = got["single"]
    assert one["packing/fallback"] == 0.0
    for name in ("data", "fsdp"):
        assert got[name]["packing/fallback"] == 0.0
        assert got[name]["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7), name
        assert got[name]["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4), name
        assert got[name]["flops"] < 1.15 * one["flops"] / 8, (name, got[name]["flops"] / one["flops"])


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    _worker()
