"""Prefix sharing in the update forward: each group's prompt forwarded once for its G rows.

`shared_prefix.token_logprobs_shared` must equal the one-pass `token_logprobs` (values of logp and
entropy, and gradients of both) on left-padded prompts of different lengths; the update step built
on it must equal the one without (metrics and new params); `make_logp_fn` must share only where
its promise holds; the loop must use it on the default (static sampler) config and nowhere else.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import DEFAULT_CONFIG, TINY

from jaxrl import losses
from jaxrl.config import LossConfig, ModelConfig, load_config
from jaxrl.models import transformer as tf
from jaxrl.models.shared_prefix import token_logprobs_shared
from jaxrl.train import loop, programs
from jaxrl.train import steps as steps_lib
from jaxrl.train.state import init_state

# 2 layers (the prompt's K/V of layer 2 depend on layer 1), GQA with 2 query heads per kv head.
CFG = ModelConfig(
    vocab_size=23, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=48, max_seq_len=16
)
N, G, P, T = 3, 4, 5, 6  # 3 groups of 4 rows
TEMP = 0.7


def _batch(seed=0, n=N, g=G):
    """n groups of g rows: group i's prompt (left-padded, real lengths 2, 5, 1, ...) repeated g times;
    every row its own completion, ragged completion masks."""
    rng = np.random.default_rng(seed)
    lengths = [2, 5, 1, 3][:n]
    prompt_NxP, pmask_NxP = np.zeros((n, P), np.int32), np.zeros((n, P), np.int32)
    for i, k in enumerate(lengths):
        prompt_NxP[i, P - k :] = rng.integers(3, CFG.vocab_size, k)
        pmask_NxP[i, P - k :] = 1
    B = n * g
    cmask_BxT = (np.arange(T)[None] < rng.integers(0, T + 1, B)[:, None]).astype(np.float32)
    return {
        "prompt_tokens_BxP": jnp.asarray(np.repeat(prompt_NxP, g, 0)),
        "prompt_mask_BxP": jnp.asarray(np.repeat(pmask_NxP, g, 0)),
        "tokens_BxT": jnp.asarray(rng.integers(3, CFG.vocab_size, (B, T)), jnp.int32),
        "completion_mask_BxT": jnp.asarray(cmask_BxT),
        "rewards_BxK": jnp.asarray(rng.integers(0, 2, (B, 1)).astype(np.float32)),
        "truncated_B": jnp.zeros((B,), jnp.float32),
    }


def _params(seed=0):
    return tf.init_params(CFG, jax.random.PRNGKey(seed))


def _one_pass(params, b):
    return tf.token_logprobs(
        params, CFG, b["prompt_tokens_BxP"], b["prompt_mask_BxP"], b["tokens_BxT"], b["completion_mask_BxT"], TEMP
    )


def _shared(params, b, group_size=G, logits_chunk=0, remat="none"):
    return token_logprobs_shared(
        params,
        CFG,
        b["prompt_tokens_BxP"],
        b["prompt_mask_BxP"],
        b["tokens_BxT"],
        TEMP,
        group_size=group_size,
        logits_chunk=logits_chunk,
        remat=remat,
    )


# The memory options compose with sharing: a chunk of 7 (row, position) pairs splits rows, and full remat.
def _objective_value_and_grad(logp_fn):
    """((value, (logp_BxT, entropy_BxT)), gradients) at _params() of a weighted sum of logp_fn's
    log-probs plus its entropies over _batch(): both outputs get gradients. The log-probs and entropies
    come out of the same program, so each case compiles once for its values and its gradients."""
    params, b = _params(), _batch()
    w_BxT = jnp.asarray(np.random.default_rng(1).normal(size=(N * G, T)), jnp.float32)

    def f(p):
        logp_BxT, entropy_BxT = logp_fn(p, b)
        return jnp.sum(w_BxT * logp_BxT) + 0.3 * jnp.sum(entropy_BxT), (logp_BxT, entropy_BxT)

    return jax.jit(jax.value_and_grad(f, has_aux=True))(params)


@functools.cache
def _one_pass_reference():
    """The one-pass ((value, values), gradients): the same for every case below, compiled once."""
    return _objective_value_and_grad(_one_pass)


@pytest.mark.slow
@pytest.mark.parametrize("logits_chunk,remat", [(0, "none"), (7, "full")])
def test_shared_prefix_equals_one_pass_values_and_gradients(logits_chunk, remat):
    def shared(p, b):
        return _shared(p, b, logits_chunk=logits_chunk, remat=remat)

    (v_plain, one_pass), g_plain = _one_pass_reference()
    (v_shared, values_shared), g_shared = _objective_value_and_grad(shared)
    for got, want in zip(values_shared, one_pass):
        assert got.shape == (N * G, T)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-5)
    np.testing.assert_allclose(float(v_shared), float(v_plain), rtol=1e-5)
    for path, x in jax.tree_util.tree_leaves_with_path(g_plain):
        y = g_shared
        for k in path:
            y = y[k.key]
        scale = float(jnp.max(jnp.abs(x)))
        assert scale > 0, path  # every parameter gets a gradient, so the comparison means something
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=0, atol=2e-5 * scale, err_msg=str(path))


def test_shared_prefix_one_completion_token_and_errors():
    params, b = _params(), _batch(n=2, g=2)
    b1 = dict(b, tokens_BxT=b["tokens_BxT"][:, :1], completion_mask_BxT=b["completion_mask_BxT"][:, :1])
    for got, want in zip(_shared(params, b1, 2), _one_pass(params, b1)):  # T = 1: only the prompt pass
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="4 rows is not a whole number of groups of 3"):
        _shared(params, b, 3)


def _count_shared(monkeypatch):
    calls = []
    real = steps_lib.token_logprobs_shared

    def counting(*args, **kwargs):
        calls.append(kwargs["group_size"])
        return real(*args, **kwargs)

    monkeypatch.setattr(steps_lib, "token_logprobs_shared", counting)
    return calls


def test_make_logp_fn_shares_only_whole_groups_of_a_dense_model(monkeypatch):
    calls = _count_shared(monkeypatch)
    params, b = _params(), _batch()

    def shapes(fn, batch):  # traces, compiles nothing
        return jax.eval_shape(fn, params, batch)

    shapes(steps_lib.make_logp_fn(CFG, TEMP, prompt_groups=G), b)
    assert calls == [G]
    shapes(steps_lib.make_logp_fn(CFG, TEMP, prompt_groups=G), jax.tree.map(lambda x: x[:6], b))  # 6 % 4 != 0
    shapes(steps_lib.make_logp_fn(CFG, TEMP), b)  # no promise
    shapes(steps_lib.make_logp_fn(CFG, TEMP, prompt_groups=1), b)  # groups of one: nothing to share
    moe = ModelConfig(**{**CFG.__dict__, "n_experts": 4, "experts_per_token": 2})
    moe_params = jax.eval_shape(lambda k: tf.init_params(moe, k), jax.random.PRNGKey(0))  # no compile
    jax.eval_shape(steps_lib.make_logp_fn(moe, TEMP, prompt_groups=G), moe_params, b)
    assert calls == [G]  # none of these shared


@pytest.mark.slow
def test_update_step_with_shared_prompts_equals_one_pass(monkeypatch):
    """Two PPO epochs (old log-probs recorded through the logp function too), a reference forward,
    2 microbatches of 2 whole groups each: metrics and new params agree with the one-pass update."""
    calls = _count_shared(monkeypatch)
    n, g = 4, 2
    b = _batch(seed=3, n=n, g=g)
    loss = losses.make_loss(LossConfig(preset="grpo", kl_beta=0.1))
    # Plain SGD: new params differ by lr x the gradients' difference. (Adam divides by sqrt(v), which
    # turns float32 noise on entries with a ~0 gradient into up to ~1e-3 of a step.)
    optimizer = optax.sgd(0.5)
    params = _params(1)
    results = []
    for groups in (g, 0):
        step = steps_lib.make_update_step(
            steps_lib.make_logp_fn(CFG, TEMP, prompt_groups=groups),
            loss,
            optimizer,
            ppo_epochs=2,
            microbatches=2,
            max_new_tokens=T,
            group_size=g,
            use_ref=True,
        )
        state = init_state(params, optimizer, jax.random.PRNGKey(0), ref_params=jax.tree.map(lambda x: x * 0.9, params))
        results.append(jax.jit(step).lower(state, b).compile()(state, b))
    assert calls and set(calls) == {g}  # the first update shared (old, ref and both epochs' forwards)
    (s_shared, m_shared), (s_plain, m_plain) = results
    assert m_plain.keys() == m_shared.keys() and float(m_plain["grad_norm"]) > 0
    for k in m_plain:
        np.testing.assert_allclose(float(m_shared[k]), float(m_plain[k]), rtol=1e-4, atol=1e-6, err_msg=k)
    moved = jax.tree.map(lambda a, b_: float(jnp.max(jnp.abs(a - b_))), s_plain.params, params)
    assert min(jax.tree.leaves(moved)) > 1e-4  # the update moved every parameter
    diff = jax.tree.map(lambda a, b_: float(jnp.max(jnp.abs(a - b_))), s_shared.params, s_plain.params)
    assert max(jax.tree.leaves(diff)) < 1e-4 * max(jax.tree.leaves(moved)), diff


def test_loop_shares_prompts_for_the_static_sampler_only():
    cfg = load_config(DEFAULT_CONFIG, TINY)
    assert not cfg.rollout.engine.enabled and cfg.train.share_prefix  # the default config: the static sampler
    assert programs.prompt_groups(cfg) == cfg.rollout.group_size == 4
    assert programs.prompt_groups(load_config(DEFAULT_CONFIG, TINY + ["train.share_prefix=false"])) == 0
    assert programs.prompt_groups(load_config(DEFAULT_CONFIG, TINY + ["rollout.engine.enabled=true"])) == 0
    agent = load_config(DEFAULT_CONFIG.parent / "agent_gridworld.py", ["train.progress=false"])
    assert agent.train.share_prefix and programs.prompt_groups(agent) == 0


class _Built(Exception):
    pass


def test_loop_builds_its_update_with_shared_prompts(tmp_path, in_process_cache, monkeypatch):
    """`build_run` hands make_logp_fn the group size on the default config (stopped right there)."""
    seen = {}

    def stop(model_cfg, temperature, **kwargs):
        seen.update(kwargs)
        raise _Built

    monkeypatch.setattr(programs, "make_logp_fn", stop)
    with pytest.raises(_Built):
        loop.train(load_config(DEFAULT_CONFIG, TINY), tmp_path / "run")
    assert seen["prompt_groups"] == 4
