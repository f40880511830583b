"""MoE: every dispatch path against the naive loop over experts, hand-worked router losses and
capacity drops, routing replay, the MoE decoder's cache paths, and ModelConfig validation."""

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import ConfigError, ModelConfig
from jaxrl.models import decode, kv_cache, moe, moe_dispatch
from jaxrl.models import transformer as tf
from jaxrl.models.decoder import run_decoder
from jaxrl.rollout.sampler import SamplingParams, sample

D, F, E, K = 8, 16, 4, 2


def _fast(fn, *args):
    return jax.jit(fn)(*args)


B, T = 2, 6  # N = 12 tokens


def _x(seed=0, shape=(B, T, D)):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


@functools.cache
def _layer_params(n_shared: int):
    spec = moe.MoESpec(E, K, F, n_shared)
    # One compiled init program, not an eager compile of every initialiser op (truncated normals, ...).
    boxed = jax.jit(moe.MoE(D, spec).init)(jax.random.PRNGKey(0), _x(), jnp.ones((B, T), bool))["params"]
    return jax.tree.map(
        lambda p: p * 3.0 if p.ndim == 2 and p.shape[-1] == E else p,  # a peakier router
        nn.meta.unbox(boxed),
    )


def _run(spec, params, x, mask, replay=None):
    return moe.MoE(D, spec).apply({"params": params}, x, mask, replay)


_run_jit = jax.jit(_run, static_argnums=0)
_capacity = jax.jit(moe_dispatch.dispatch_capacity, static_argnums=7)
_naive = jax.jit(moe_dispatch.dispatch_naive)


@pytest.mark.slow
@pytest.mark.parametrize("router,n_shared", [("softmax", 0), ("sigmoid", 2)])
def test_dispatch_paths_equal_naive_loop_outputs_and_gradients(router, n_shared):
    """Dropless (ragged_dot and blocked grouped matmuls) and capacity (C = N: nothing can drop) give
    the naive loop's outputs, router losses and gradients with respect to every parameter and the input."""
    params = _layer_params(n_shared)
    x, mask = _x(1), jnp.ones((B, T), bool).at[0, :2].set(False)
    r = _x(2) * mask[..., None]  # a fixed random cotangent; capacity gives padding no expert output

    def loss(spec, p, x):
        y, st = _run(spec, p, x, mask)
        return jnp.sum(y * r) + st.aux_loss + st.z_loss, (y, st)

    out = {}
    # lax.ragged_dot is the same code whatever the router: checked once, to save a CPU compile.
    paths = ("dropless", "blocked", "capacity") if router == "softmax" else ("blocked", "capacity")
    for dispatch in ("naive",) + paths:
        spec = moe.MoESpec(
            E,
            K,
            F,
            n_shared,
            router,
            "dropless" if dispatch == "blocked" else dispatch,
            capacity_factor=E / K,
            grouped_matmul="blocked" if dispatch == "blocked" else "ragged",
        )
        assert dispatch != "capacity" or moe_dispatch.capacity(B * T, K, E, E / K) == B * T
        (_, aux), grads = _fast(
            jax.value_and_grad(functools.partial(loss, spec), argnums=(0, 1), has_aux=True), params, x
        )
        out[dispatch] = aux, grads
    (y0, st0), g0 = out["naive"]
    assert float(st0.dropped_frac) == 0.0 and len(set(np.asarray(st0.experts_NxK).ravel().tolist())) == E
    for dispatch in paths:
        (y, st), g = out[dispatch]
        np.testing.assert_array_equal(st.experts_NxK, st0.experts_NxK)
        live = np.asarray(mask).reshape(B, T)  # capacity gives padding no expert: compare live tokens
        np.testing.assert_allclose(np.asarray(y)[live], np.asarray(y0)[live], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(st.aux_loss, st0.aux_loss, rtol=1e-6)
        assert float(st.dropped_frac) == 0.0
        if dispatch != "capacity":  # no token is special: padding too gets the naive output
            np.testing.assert_allclose(y, y0, atol=1e-5, rtol=1e-5)
        for path, a, b in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g0), jax.tree.leaves(g)):
            assert float(jnp.max(jnp.abs(a))) > 0, path[0]
            np.testing.assert_allclose(b, a, atol=2e-5, rtol=1e-4, err_msg=f"{dispatch} {path[0]}")


def test_capacity_drops_and_counts_hand_case():
    """E=2, K=1, N=4, capacity_factor 0.5 -> C = ceil(0.5*4*1/2) = 1 slot per expert. Tokens 0,1,2 pick
    expert 0 and token 3 expert 1: expert 0 keeps token 0 (first in order), tokens 1, 2 are dropped
    (output 0), dropped_frac = 2/4. With token 0 marked padding, token 1 takes the slot: 1/3 dropped."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(4, D)), jnp.float32)
    wg, wu = (jnp.asarray(rng.normal(size=(2, D, F)), jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.normal(size=(2, F, D)), jnp.float32)
    experts, gates = jnp.array([[0], [0], [0], [1]], jnp.int32), jnp.ones((4, 1), jnp.float32)
    assert moe_dispatch.capacity(4, 1, 2, 0.5) == 1
    full = np.asarray(_naive(x, wg, wu, wd, experts, gates))
    y, dropped = _capacity(x, wg, wu, wd, experts, gates, jnp.ones(4, bool), 0.5)
    assert float(dropped) == 0.5
    np.testing.assert_allclose(np.asarray(y)[[0, 3]], full[[0, 3]], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(y)[[1, 2]], 0.0)
    y, dropped = _capacity(x, wg, wu, wd, experts, gates, jnp.array([False, True, True, True]), 0.5)
    np.testing.assert_allclose(float(dropped), 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(y)[[1, 3]], full[[1, 3]], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(y)[[0, 2]], 0.0)
    # Priority is k-major: with K=2 every first choice is placed before any second choice. Token 0's
    # second choice (expert 1) loses the one slot of expert 1 to token 1's first choice.
    experts2, gates2 = jnp.array([[0, 1], [1, 0]], jnp.int32), jnp.full((2, 2), 0.5, jnp.float32)
    y, dropped = _capacity(x[:2], wg, wu, wd, experts2, gates2, jnp.ones(2, bool), 0.5)
    assert moe_dispatch.capacity(2, 2, 2, 0.5) == 1 and float(dropped) == 0.5
    want = _naive(x[:2], wg, wu, wd, experts2[:, :1], gates2[:, :1])
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_router_losses_hand_worked():
    """Top-1 of softmax over E=2. Tokens 0, 1 have logits (ln 3, 0) -> probs (3/4, 1/4), expert 0;
    token 2 has (0, ln 3) -> expert 1; token 3 is padding with extreme logits and must not count.
    f = (2/3, 1/3), P = ((.75+.75+.25)/3, (.25+.25+.75)/3), aux = 2*(2/3*1.75/3 + 1/3*1.25/3) = 19/18.
    z: logsumexp = ln 4 for every live token -> z_loss = (ln 4)^2."""
    ln3 = math.log(3.0)
    logits = jnp.array([[ln3, 0.0], [ln3, 0.0], [0.0, ln3], [0.0, 40.0]])
    mask = jnp.array([1, 1, 1, 0])
    gates, experts, topk, scores = moe.route(logits, 1, "softmax")
    np.testing.assert_array_equal(experts[:, 0], [0, 0, 1, 1])
    np.testing.assert_allclose(gates, 1.0)
    np.testing.assert_allclose(moe.load_balance_loss(scores, experts, mask, "softmax"), 19 / 18, rtol=1e-6)
    np.testing.assert_allclose(moe.router_z_loss(logits, mask), math.log(4.0) ** 2, rtol=1e-6)
    # Perfect balance gives exactly 1 (the loss's minimum under uniform probs).
    uniform = jnp.zeros((4, 2))
    np.testing.assert_allclose(
        moe.load_balance_loss(jax.nn.softmax(uniform), jnp.array([[0], [1], [0], [1]]), jnp.ones(4), "softmax"),
        1.0,
        rtol=1e-6,
    )
    # Top-2 of 3 renormalised (Qwen3-MoE): probs (.5, .3, .2) -> gates (.5/.8, .3/.8); sigmoid likewise.
    lg = jnp.log(jnp.array([[0.5, 0.3, 0.2]]))
    g, ex, _, _ = moe.route(lg, 2, "softmax")
    np.testing.assert_array_equal(ex, [[0, 1]])
    np.testing.assert_allclose(g, [[0.625, 0.375]], rtol=1e-6)
    s = jax.nn.sigmoid(lg)[0]
    g, _, _, _ = moe.route(lg, 2, "sigmoid")
    np.testing.assert_allclose(g, [[s[0] / (s[0] + s[1]), s[1] / (s[0] + s[1])]], rtol=1e-6)


@pytest.mark.slow
def test_replay_own_experts_is_exact_and_other_experts_route_gradients_to_the_router():
    params, x, mask = _layer_params(1), _x(4), jnp.ones((B, T), bool)
    spec = moe.MoESpec(E, K, F, 1)
    y, st = _run_jit(spec, params, x, mask)
    y2, st2 = _run_jit(spec, params, x, mask, st.experts_NxK.reshape(B, T, K))
    np.testing.assert_array_equal(y2, y)
    np.testing.assert_array_equal(st2.experts_NxK, st.experts_NxK)
    other = (st.experts_NxK + 1) % E  # a different (still distinct) pair for every token
    y3, st3 = _run_jit(spec, params, x, mask, other.reshape(B, T, K))
    np.testing.assert_array_equal(st3.experts_NxK, other)
    np.testing.assert_array_equal(st3.topk_NxK, st.topk_NxK)  # the router's own choice is still reported
    assert float(jnp.max(jnp.abs(y3 - y))) > 1e-3
    g = jax.jit(jax.grad(lambda p: jnp.sum(_run(spec, p, x, mask, other.reshape(B, T, K))[0])))(params)
    assert float(jnp.max(jnp.abs(g["router"]))) > 0


def test_dense_defaults_leave_the_model_unchanged():
    """Golden logits of the dense test model, recorded before MoE existed; MoE fields are inert at n_experts=0."""
    cfg = ModelConfig(vocab_size=29, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
    assert cfg.n_experts == 0 and cfg.n_moe_layers == 0
    inert = dataclasses.replace(cfg, moe_every=2, router="sigmoid", moe_dispatch="capacity", n_shared_experts=3)
    toks = jnp.asarray(np.arange(18).reshape(2, 9) % 29, jnp.int32)
    params = tf.init_params(cfg, jax.random.PRNGKey(0))
    assert "moe" not in str(jax.tree_util.tree_structure(params))

    def shapes(c):
        return jax.tree.map(lambda a: a.shape, jax.eval_shape(tf.init_params, c, jax.random.PRNGKey(0)))

    assert shapes(inert) == shapes(cfg)
    lg = np.asarray(tf.forward(params, cfg, toks, jnp.ones((2, 9), jnp.int32)))
    np.testing.assert_allclose(
        lg[:, -1, :4],
        [[0.7207121, 0.30973983, -0.66454387, 0.38622206], [-0.91664314, 1.1282098, 1.2681333, 1.0652928]],
        rtol=1e-5,
    )
    np.testing.assert_allclose(lg.sum(), 59.542930603027344, rtol=1e-4)


MCFG = ModelConfig(
    vocab_size=29,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    mlp_dim=48,
    n_experts=4,
    moe_every=2,
    experts_per_token=2,
    expert_mlp_dim=32,
    n_shared_experts=1,
)


@functools.cache
def _mparams(cfg=MCFG):
    return tf.init_params(cfg, jax.random.PRNGKey(0))


@jax.jit
def _mforward(params, seq_BxS, mask_BxS):
    """MCFG's scanned forward -> (logits, aux, routing). One program for both tests below: they feed it
    the same shapes (6 rows of 9 tokens), so a worker that runs both compiles it once."""
    return run_decoder(params, MCFG, seq_BxS, tf.positions_from_mask(mask_BxS), mask_BxS.astype(bool))


def test_moe_model_params_and_axes():
    params, axes = _mparams(), tf.param_logical_axes(MCFG)
    assert set(params["blocks"]) == {"dense_0", "moe"}  # one scanned group = 1 dense + 1 MoE layer
    m = params["blocks"]["moe"]["moe"]
    assert m["gate"].shape == (1, 4, 32, 32) and m["down"].shape == (1, 4, 32, 32) and m["router"].shape == (1, 32, 4)
    assert m["shared"]["up"].shape == (1, 32, 32) and params["blocks"]["dense_0"]["mlp"]["up"].shape == (1, 32, 48)
    assert tuple(axes["blocks"]["moe"]["moe"]["gate"]) == ("layers", "expert", "embed", "mlp")
    assert tuple(axes["blocks"]["moe"]["moe"]["down"]) == ("layers", "expert", "mlp", "embed")
    for p, spec in zip(jax.tree.leaves(params), jax.tree.leaves(axes)):
        assert len(spec) == p.ndim and set(spec) <= set(tf.LOGICAL_AXIS_NAMES) | {None}


@pytest.mark.slow
def test_moe_forward_equals_prefill_and_decode_paths():
    """Scanned forward == prefill + decode_layers (the sampler's unrolled loop), logits and
    experts, on a left-padded batch (6 rows: the routing test's forward shape)."""
    params, P, Tg, B = _mparams(), 5, 4, 6
    rng = np.random.default_rng(5)
    prompt = jnp.asarray(rng.integers(1, 29, (B, P)), jnp.int32)
    pads_B = np.array([2, 0, 4, 1, 3, 0])  # left padding per row: 3, 5, 1, 4, 2, 5 real prompt tokens
    pmask = jnp.asarray(np.arange(P)[None] >= pads_B[:, None], jnp.int32)
    gen = jnp.asarray(rng.integers(1, 29, (B, Tg)), jnp.int32)
    seq, smask = jnp.concatenate([prompt, gen], 1), jnp.concatenate([pmask, jnp.ones((B, Tg), jnp.int32)], 1)
    logits, _, out = _mforward(params, seq, smask)
    experts = np.asarray(out.experts_LxBxTxK)  # (1, B, P+Tg, 2)
    cache = kv_cache.init_cache(MCFG, B, P + Tg)

    def prefill(p, t, m, c):
        return kv_cache.prefill(p, MCFG, t, m, c)

    last, cache, pre_experts = _fast(prefill, params, prompt, pmask, cache)
    np.testing.assert_allclose(last, logits[:, P - 1], atol=1e-5)
    # Live prompt slots only: a padding slot's query attends to no key, so its hidden state (and
    # experts) depend on what the unread keys hold: the full sequence here, an empty cache there.
    live_BxP = np.asarray(pmask, bool)
    np.testing.assert_array_equal(np.asarray(pre_experts)[:, live_BxP], experts[:, :, :P][:, live_BxP])
    lparams, lcache = decode.layer_params(params, MCFG), decode.to_layer_cache(cache)
    step = jax.jit(lambda lp, tok, c, i: decode.decode_layers(lp, MCFG, tok[:, None], c, i))
    for t in range(Tg):
        lg2, lcache, ex = step(lparams, gen[:, t], lcache, jnp.int32(P + t))
        np.testing.assert_allclose(lg2[:, 0], logits[:, P + t], atol=1e-5)
        np.testing.assert_array_equal(ex[:, 0, 0], experts[0, :, P + t])


@pytest.mark.slow
def test_one_forward_per_layer_layout_equals_scanned_and_replays_routing():
    """`run_decoder` on per-layer params (the decode loops' layout, here without a cache) gives the
    scanned layout's logits, experts and MoE losses (an MoE group then a dense tail layer); routing
    replay is an input of both: each then uses the replayed experts, and the logits agree again."""
    cfg = dataclasses.replace(MCFG, n_layers=3, dense_tail_layers=1)
    params = tf.init_params(cfg, jax.random.PRNGKey(2))
    lparams = decode.layer_params(params, cfg)
    assert isinstance(lparams["blocks"], tuple) and len(lparams["tail"]) == 1
    rng = np.random.default_rng(8)
    seq_BxS = jnp.asarray(rng.integers(1, 29, (3, 7)), jnp.int32)
    mask_BxS = jnp.asarray(np.arange(7)[None] >= np.array([[2], [0], [4]]))
    run = jax.jit(run_decoder, static_argnames="cfg")
    args = (seq_BxS, tf.positions_from_mask(mask_BxS), mask_BxS)
    scanned, _, s_moe = run(params, cfg, *args, moe_mask_BxT=mask_BxS)
    unrolled, kv, u_moe = run(lparams, cfg, *args, moe_mask_BxT=mask_BxS)
    assert kv == (None, None, None) and s_moe is not None and u_moe is not None
    np.testing.assert_allclose(unrolled, scanned, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(u_moe.experts_LxBxTxK, s_moe.experts_LxBxTxK)
    np.testing.assert_allclose(u_moe.aux_loss, s_moe.aux_loss, rtol=1e-6)
    replay_LxBxSxK = jnp.asarray(np.argsort(rng.random((1, 3, 7, 4)), axis=-1)[..., :2], jnp.int32)
    assert np.any(np.asarray(replay_LxBxSxK) != np.asarray(s_moe.experts_LxBxTxK))
    s_rep, _, s_rep_moe = run(params, cfg, *args, replay_LxBxTxK=replay_LxBxSxK, moe_mask_BxT=mask_BxS)
    u_rep, _, u_rep_moe = run(lparams, cfg, *args, replay_LxBxTxK=replay_LxBxSxK, moe_mask_BxT=mask_BxS)
    for out in (s_rep_moe, u_rep_moe):
        np.testing.assert_array_equal(out.experts_LxBxTxK, replay_LxBxSxK)
    np.testing.assert_allclose(u_rep, s_rep, atol=1e-5, rtol=0)
    assert np.abs(np.asarray(s_rep) - np.asarray(scanned)).max() > 1e-3  # the replay changed the forward


def test_one_forward_names_the_cache_kinds_it_takes():
    """A per-layer cache entry must be a typed kind: a bare (k, v) tuple is refused by name."""
    params = decode.layer_params(_mparams(), MCFG)
    k_BxKxSxHd = jnp.zeros((1, 2, 4, 8))
    tokens_1x1 = jnp.ones((1, 1), jnp.int32)
    with pytest.raises(TypeError, match="type tuple; expected one of .*LayerKV"):
        run_decoder(params, MCFG, tokens_1x1, tokens_1x1, jnp.ones((1, 4), bool), 0, [(k_BxKxSxHd, k_BxKxSxHd)] * 2)
    with pytest.raises(ValueError, match="n_layers=1 needs per-layer params"):
        run_decoder(_mparams(), MCFG, tokens_1x1, tokens_1x1, jnp.ones((1, 1), bool), n_layers=1)


class _ZeroLoss:
    """A loss whose token part is 0: what remains of the update's loss is the MoE router penalty."""

    def token_loss(self, logp_BxT, mb):
        return jnp.zeros_like(logp_BxT), {}


@pytest.mark.slow
def test_sampler_routing_replay_and_mismatch():
    """The sampler records the experts of every fed slot; replaying them, the trainer's log-probs equal
    the sampler's; the mismatch metric is 0 with unchanged params and > 0 after perturbing the router,
    where replay and no-replay log-probs then differ."""
    from jaxrl.train.steps import make_grad_fn, make_logp_fn

    params, P, Tn, G = _mparams(), 5, 4, 3
    rng = np.random.default_rng(6)
    prompt = jnp.asarray(rng.integers(1, 29, (2, P)), jnp.int32)
    pmask = jnp.array([[0, 1, 1, 1, 1], [1] * 5], jnp.int32)
    out = _fast(
        lambda p, pr, pm: sample(
            p,
            MCFG,
            pr,
            pm,
            jax.random.PRNGKey(1),
            group_size=G,
            sampling=SamplingParams(max_new_tokens=Tn, temperature=1.0, eos_id=29, pad_id=0),
        ),
        params,
        prompt,
        pmask,
    )
    routing = out.routing_BxSxLxK
    assert routing.shape == (2 * G, P + Tn, 1, 2) and routing.dtype == jnp.int32
    batch = {
        "prompt_tokens_BxP": jnp.repeat(prompt, G, 0),
        "prompt_mask_BxP": jnp.repeat(pmask, G, 0),
        "tokens_BxT": out.tokens_BxT,
        "completion_mask_BxT": out.completion_mask_BxT,
        "routing_BxSxLxK": routing,
    }
    seq = jnp.concatenate([batch["prompt_tokens_BxP"], out.tokens_BxT], 1)
    smask = jnp.concatenate([batch["prompt_mask_BxP"], jnp.ones_like(out.tokens_BxT)], 1)
    _, _, fwd = _mforward(params, seq, smask)
    own = np.transpose(np.asarray(fwd.experts_LxBxTxK), (1, 2, 0, 3))
    live = np.asarray(smask, bool)[:, : P + Tn - 1]  # padding slots' outputs are never read; the last is never fed
    np.testing.assert_array_equal(np.asarray(routing)[:, : P + Tn - 1][live], own[:, : P + Tn - 1][live])
    replay_fn, plain_fn = jax.jit(make_logp_fn(MCFG, 1.0, routing_replay=True)), jax.jit(make_logp_fn(MCFG, 1.0))
    logp, _, ex = replay_fn(params, batch)
    np.testing.assert_allclose(logp, out.logp_BxT, atol=1e-5)
    assert float(jnp.sum(ex["moe/routing_mismatch_BxT"])) == 0.0
    assert float(ex["moe/aux_loss"]) > 0.5 and float(ex["moe/z_loss"]) > 0 and float(ex["moe/dropped_frac"]) == 0
    # A row's last live token was never fed, so nothing recorded its experts (the sampler leaves 0):
    # replay lets the router choose there, so at unchanged params the router penalty is the plain one's.
    _, _, ex_plain = jax.jit(make_logp_fn(MCFG, 1.0))(params, batch)
    np.testing.assert_allclose(ex["moe/aux_loss"], ex_plain["moe/aux_loss"], rtol=1e-6)
    cmask = np.asarray(out.completion_mask_BxT) > 0
    last_B = P + cmask.shape[1] - 1 - np.argmax(cmask[:, ::-1], axis=1)
    unfed = np.asarray(routing)[np.arange(2 * G), last_B]
    own_last = own[np.arange(2 * G), last_B]
    assert np.any(np.sort(unfed, -1) != np.sort(own_last, -1))  # the recorded value there is not the router's
    # The update's gradient program: with zero token weights its loss is exactly the router penalty.
    grad_fn = jax.jit(
        make_grad_fn(make_logp_fn(MCFG, 1.0, routing_replay=True), _ZeroLoss(), microbatches=1, old_logp_recorded=True)
    )
    value, grads, sums = grad_fn(params, dict(batch, weights_BxT=jnp.zeros_like(out.logp_BxT)))
    np.testing.assert_allclose(
        value, MCFG.moe_aux_coef * ex["moe/aux_loss"] + MCFG.moe_z_coef * ex["moe/z_loss"], rtol=1e-5
    )
    np.testing.assert_allclose(sums["moe/aux_loss"]["sum"], ex["moe/aux_loss"], rtol=1e-6)
    assert float(sums["moe/routing_mismatch"]["sum"]) == 0.0
    assert float(jnp.max(jnp.abs(grads["blocks"]["moe"]["moe"]["router"]))) > 0
    # Perturb the router: the trainer's own top-k now differs from the rollout's on some tokens.
    router = params["blocks"]["moe"]["moe"]["router"]
    noise = jnp.asarray(np.random.default_rng(7).normal(size=router.shape), jnp.float32)
    moved = jax.tree.map(lambda p: p, params)
    moved["blocks"]["moe"]["moe"]["router"] = router + 0.5 * noise
    logp_r, _, ex_r = replay_fn(moved, batch)
    logp_p, _, ex_p = plain_fn(moved, batch)
    mism = np.asarray(ex_r["moe/routing_mismatch_BxT"])
    assert 0 < mism.mean() < 1, mism
    np.testing.assert_array_equal(ex_p["moe/routing_mismatch_BxT"], mism)  # same routers, same inputs at layer 1
    rows = np.any(mism > 0, axis=1)
    assert float(jnp.max(jnp.abs(logp_r - logp_p))) > 1e-4
    np.testing.assert_allclose(np.asarray(logp_r)[~rows], np.asarray(logp_p)[~rows], atol=1e-5)


@pytest.mark.parametrize(
    "field,value",
    [
        ("n_experts", -1),
        ("moe_every", 3),
        ("moe_every", 0),
        ("experts_per_token", 0),
        ("experts_per_token", 5),
        ("expert_mlp_dim", -1),
        ("n_shared_experts", -1),
        ("router", "relu"),
        ("moe_dispatch", "sorted"),
        ("capacity_factor", 0.0),
        ("moe_aux_coef", -0.1),
        ("moe_z_coef", -1.0),
    ],
)
def test_config_validation_names_the_field(field, value):
    cfg = dataclasses.replace(MCFG, **{field: value})
    with pytest.raises(ConfigError, match=rf"^model\.{field}: got"):
        cfg.validate()
    MCFG.validate()


@pytest.mark.slow
def test_blocked_grouped_matmul_skewed_groups():
    """Blocked dropless with groups of 0, 1 and more-than-a-block rows equals the naive loop. Slots per
    expert: 1, 150, 0, 149 of S = 300; block = min(128, ceil(300 / 4)) = 75, so experts 1 and 3 span
    two blocks each and expert 0's single row shares its block with 74 pad rows."""
    rng = np.random.default_rng(8)
    n = 150
    x = jnp.asarray(rng.normal(size=(n, D)), jnp.float32)
    wg, wu = (jnp.asarray(rng.normal(size=(E, D, F)), jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.normal(size=(E, F, D)), jnp.float32)
    first = np.where(np.arange(n) < 140, 1, 3)  # first choices: expert 1 x 139, 3 x 10, 0 x 1, 2 never
    first[0] = 0
    experts = jnp.asarray(np.stack([first, np.where(first == 1, 3, 1)], 1), jnp.int32)
    experts = experts.at[0, 1].set(1)
    gates = jnp.asarray(rng.uniform(size=(n, 2)), jnp.float32)
    blocked = jax.jit(functools.partial(moe_dispatch.dispatch_dropless, grouped_matmul="blocked"))
    np.testing.assert_allclose(
        blocked(x, wg, wu, wd, experts, gates), _naive(x, wg, wu, wd, experts, gates), rtol=1e-4, atol=1e-4
    )
    # The blocked path's backward is hand-written: every gradient, including an expert with no slot.
    r = jnp.asarray(rng.normal(size=(n, D)), jnp.float32)

    def loss(f):
        return lambda *a: jnp.sum(f(*a, experts, gates) * r)

    got = jax.jit(jax.grad(loss(blocked), argnums=(0, 1, 2, 3)))(x, wg, wu, wd)
    want = jax.grad(loss(_naive), argnums=(0, 1, 2, 3))(x, wg, wu, wd)
    for name, g, w in zip(("x", "w_gate", "w_up", "w_down"), got, want):
        scale = float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * scale, err_msg=name)
    assert float(jnp.max(jnp.abs(got[1][2]))) == 0.0  # expert 2 got no slot
