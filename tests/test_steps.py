"""Training steps: exact microbatching, the gradient itself, the update step, optimizer and schedule.

One tiny model (d_model 32, 1 layer, vocab 23) and one (B=8, P=4 | T=5) batch shape everywhere.
Compiling a gradient program costs seconds on CPU, so the file builds few of them and reuses
each: `make_grad_fn` reads only `loss.token_loss`, which grpo and dr_grpo share (PPO clip + k3
KL), so one program per microbatch count serves both presets, whose weights are data.
Reference quantities are written out here from `token_logprobs` and the papers' formulas,
independently of `jaxrl.losses` and `jaxrl.train.steps`.

Compile time dominates this file on CPU: tests/harness.py's compile policy keeps it low.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl import losses
from jaxrl.config import ModelConfig, OptimConfig
from jaxrl.models.transformer import init_params, token_logprobs
from jaxrl.train import steps as steps_lib
from jaxrl.train.state import init_state, learning_rate_schedule, make_optimizer

V, P, T, B = 23, 4, 5, 8
G = 2  # the update steps' group size: 4 groups of 2 adjacent rows
PAD, BOS = 0, 1
CFG = ModelConfig(
    vocab_size=V, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64, max_seq_len=16
)
TEMP = 0.9
EPS = 0.2
KL_BETA = 0.1
PRESETS = ("grpo", "dr_grpo")
# Ragged completion lengths: full, short, one fully masked row (row 2), length 1. With m = 2 or 4
# the microbatches hold different numbers of live rows and tokens, which is exactly what
# per-microbatch normalisation would get wrong.
LENGTHS = np.array([5, 2, 0, 3, 1, 5, 4, 2])

LOGP_FN = steps_lib.make_logp_fn(CFG, TEMP)


@functools.cache
def _params(seed=0):
    return init_params(CFG, jax.random.PRNGKey(seed))


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _perturb(params, scale, seed):
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(treedef, [x + scale * jnp.asarray(rng.normal(size=x.shape), jnp.float32) for x in leaves])


def _batch(seed=0, adv=None, rewards=None):
    """Random left-padded prompts (BOS first, some PAD), random completions with PAD after the end.
    advantages_B are given (the gradient programs take them as data); `_rollout` drops them."""
    rng = np.random.default_rng(seed)
    plen = rng.integers(1, P + 1, size=B)
    plen[:2] = (1, P)  # one prompt of only BOS, one without padding
    prompt = np.full((B, P), PAD, np.int32)
    pmask = np.zeros((B, P), np.int32)
    for i, n in enumerate(plen):
        prompt[i, P - n :] = rng.integers(3, V, n)
        prompt[i, P - n] = BOS
        pmask[i, P - n :] = 1
    cmask = (np.arange(T)[None, :] < LENGTHS[:, None]).astype(np.float32)
    tokens = np.where(cmask > 0, rng.integers(3, V, (B, T)), PAD).astype(np.int32)
    adv = rng.normal(size=B).astype(np.float32) if adv is None else np.asarray(adv, np.float32)
    return {
        "prompt_tokens_BxP": jnp.asarray(prompt),
        "prompt_mask_BxP": jnp.asarray(pmask),
        "tokens_BxT": jnp.asarray(tokens),
        "completion_mask_BxT": jnp.asarray(cmask),
        "advantages_B": jnp.asarray(adv),
        # carried by the real loop's batch; must split along rows without getting in the way
        "rewards_BxK": jnp.asarray(rng.random((B, 2)).astype(np.float32) if rewards is None else rewards),
        "truncated_B": jnp.asarray((LENGTHS == T).astype(np.float32)),
    }


def _rollout(batch):
    """The update step's input: what the loop sends, rewards but no advantages (the update computes them)."""
    return {k: v for k, v in batch.items() if k != "advantages_B"}


def _advantages(loss, batch):
    return loss.advantages(batch["rewards_BxK"], G)


def _model_logp(params, batch):
    """(logp_BxT, entropy_BxT) of the batch's completions: the model, called directly."""
    return token_logprobs(
        params,
        CFG,
        batch["prompt_tokens_BxP"],
        batch["prompt_mask_BxP"],
        batch["tokens_BxT"],
        batch["completion_mask_BxT"],
        TEMP,
    )


_compiled_logp = jax.jit(lambda params, *arrays: token_logprobs(params, CFG, *arrays, TEMP))


def _logp(params, batch):
    """_model_logp, compiled once for every batch dict of the file's shapes."""
    return _compiled_logp(
        params, batch["prompt_tokens_BxP"], batch["prompt_mask_BxP"], batch["tokens_BxT"], batch["completion_mask_BxT"]
    )


def _with_old_and_ref(params, batch, seed=1, ref_padding=None):
    """Recorded old log-probs ~0.3 away from the current ones (both clip sides active), with huge
    garbage on masked tokens that must not leak (inf/NaN) anywhere; a reference ~0.2 away, and on
    masked tokens `ref_padding` (None: a model-like finite value, as update_step's own reference
    forward produces)."""
    rng = np.random.default_rng(seed)
    logp = np.asarray(_logp(params, batch)[0])
    live = np.asarray(batch["completion_mask_BxT"]) > 0
    old = np.where(live, logp + 0.3 * rng.normal(size=logp.shape), -1e4).astype(np.float32)
    ref = logp + 0.2 * rng.normal(size=logp.shape)
    if ref_padding is not None:
        ref = np.where(live, ref, ref_padding)
    return dict(batch, old_logp_BxT=jnp.asarray(old), ref_logp_BxT=jnp.asarray(ref.astype(np.float32)))


def _paper_weights(preset, mask_BxT):
    """GRPO: 1/(B_live |y_i|); Dr.GRPO: 1/(B_live L_max), L_max = max_new_tokens = T here."""
    m = (np.asarray(mask_BxT) > 0).astype(np.float64)
    lengths = m.sum(1)
    live_rows = (lengths > 0).sum()
    if preset == "grpo":
        return (m / (np.maximum(lengths, 1)[:, None] * live_rows)).astype(np.float32)
    return (m / (live_rows * T)).astype(np.float32)


def _max_abs(tree):
    return max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(tree))


def _assert_trees_close(actual, expected, rel=1e-5):
    """Same structure; every leaf within rel * (largest entry of the expected tree)."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    atol = rel * max(_max_abs(expected), 1e-12)
    for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))


def _loss(preset, kl_beta=KL_BETA):
    return losses.PRESETS[preset](eps_low=EPS, kl_beta=kl_beta)


@functools.cache
def _grad_fn(microbatches):
    """Recorded old log-probs (the PPO-epochs path): ratios != 1, clipping, a KL term."""
    return jax.jit(steps_lib.make_grad_fn(LOGP_FN, _loss("grpo"), microbatches=microbatches, old_logp_recorded=True))


@functools.cache
def _setup(preset):
    params = _params()
    batch = _with_old_and_ref(params, _batch())
    return params, dict(batch, weights_BxT=_loss(preset).weights(batch["completion_mask_BxT"], T))


# ----------------------------------------------------------------------------- plumbing


def test_split_microbatches_keeps_row_order():
    # microbatched_logp itself is checked through the recorded old log-probs of the PPO-epochs test
    batch = _batch()
    mbs = steps_lib.split_microbatches(batch, 4)
    assert mbs["tokens_BxT"].shape == (4, 2, T) and mbs["rewards_BxK"].shape == (4, 2, 2)
    np.testing.assert_array_equal(mbs["tokens_BxT"][1], batch["tokens_BxT"][2:4])
    np.testing.assert_array_equal(mbs["advantages_B"][3], batch["advantages_B"][6:8])
    jax.tree.map(np.testing.assert_array_equal, steps_lib.merge_microbatches(mbs), batch)


def test_presets_share_token_loss_and_weights_follow_the_papers():
    """What lets one gradient program per m serve both presets: only the weights differ."""
    _, batch = _setup("grpo")
    logp = _logp(_params(), batch)[0]
    out_g, out_d = jax.jit(lambda lp, b: (_loss("grpo").token_loss(lp, b), _loss("dr_grpo").token_loss(lp, b)))(
        logp, batch
    )
    jax.tree.map(np.testing.assert_array_equal, out_g, out_d)
    for preset in PRESETS:
        w = _loss(preset).weights(batch["completion_mask_BxT"], T)
        np.testing.assert_allclose(w, _paper_weights(preset, batch["completion_mask_BxT"]), rtol=1e-6)
        assert np.all(np.asarray(w)[2] == 0)  # the empty row


# ----------------------------------------------------------------------------- microbatch exactness


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_microbatches_give_the_full_batch_loss_gradient_and_stats(preset):
    params, batch = _setup(preset)
    v1, g1, s1 = _grad_fn(1)(params, batch)
    # a real, finite gradient (the garbage old/ref log-probs on masked tokens do not leak)
    assert np.isfinite(float(v1)) and _max_abs(g1) > 1e-4
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(g1))
    assert set(s1) == {"ratio_BxT", "clipped_low_BxT", "clipped_high_BxT", "kl_BxT", "entropy", "kl"}
    # the stat sums are masked sums over live tokens, by hand
    logp, entropy = _logp(params, batch)
    live = batch["completion_mask_BxT"] > 0
    d = jnp.where(live, batch["ref_logp_BxT"] - logp, 0.0)
    by_hand = {
        "entropy": jnp.sum(jnp.where(live, entropy, 0.0)),
        "ratio_BxT": jnp.sum(jnp.where(live, jnp.exp(logp - batch["old_logp_BxT"]), 0.0)),
        "kl": jnp.sum(jnp.exp(d) - d - 1.0),
    }
    for k, v in by_hand.items():
        np.testing.assert_allclose(float(s1[k]["sum"]), float(v), rtol=1e-5, err_msg=k)
    # both clip sides active, so the clipped (zero-gradient) branch is part of what is compared
    assert float(s1["clipped_low_BxT"]["sum"]) > 0 and float(s1["clipped_high_BxT"]["sum"]) > 0
    for m in (2, 4):
        v, g, s = _grad_fn(m)(params, batch)
        np.testing.assert_allclose(float(v), float(v1), rtol=1e-5, atol=1e-7)
        _assert_trees_close(g, g1, rel=1e-5)
        assert set(s) == set(s1)
        for k in s1:
            np.testing.assert_allclose(float(s[k]["sum"]), float(s1[k]["sum"]), rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("preset", PRESETS)
def test_per_microbatch_normalisation_would_be_caught(preset):
    """Sensitivity of the test above: weights computed per microbatch (live rows counted within
    each microbatch) give a gradient the exactness check rejects by a wide margin."""
    params, good = _setup(preset)
    m = 4
    chunks = steps_lib.split_microbatches({"m": good["completion_mask_BxT"]}, m)["m"]
    wrong_w = jnp.concatenate([_loss(preset).weights(c, T) for c in chunks])
    assert not np.allclose(wrong_w, good["weights_BxT"])
    _, g_ref, _ = _grad_fn(1)(params, good)
    _, g_bad, _ = _grad_fn(m)(params, dict(good, weights_BxT=wrong_w))
    with pytest.raises(AssertionError):
        _assert_trees_close(g_bad, g_ref, rel=1e-5)
    diff = jax.tree.map(jnp.subtract, g_bad, g_ref)
    assert _max_abs(diff) > 0.05 * _max_abs(g_ref)  # not a rounding-level miss


@pytest.mark.parametrize("ref_padding", [1e4, -1e4])
def test_garbage_reference_on_padding_leaves_stats_finite(ref_padding):
    """A caller's ref_logp_BxT may hold garbage on masked tokens (the losses promise to ignore it:
    see ratios.py / regularizers.kl_penalty). The KL loss term does; the reported `kl` stat sum
    must too, and stay the masked sum over live tokens."""
    params, clean = _setup("grpo")
    batch = _with_old_and_ref(params, _batch(), ref_padding=ref_padding)
    batch["weights_BxT"] = clean["weights_BxT"]
    v, g, s = _grad_fn(1)(params, batch)
    v_clean, g_clean, s_clean = _grad_fn(1)(params, clean)  # same live values, finite padding
    np.testing.assert_allclose(float(v), float(v_clean), rtol=1e-6)
    _assert_trees_close(g, g_clean, rel=1e-6)
    for k in s_clean:
        assert np.isfinite(float(s[k]["sum"])), k
        np.testing.assert_allclose(float(s[k]["sum"]), float(s_clean[k]["sum"]), rtol=1e-6, err_msg=k)


# ----------------------------------------------------------------------------- the gradient itself


def _paper_loss_and_grad(params, batch, w_BxT):
    """sum_{i,t} w_it * [-min(rho A, clip(rho, 1-eps, 1+eps) A) + beta * k3] over the WHOLE batch."""

    def loss(p):
        logp, _ = _model_logp(p, batch)
        m = batch["completion_mask_BxT"] > 0
        rho = jnp.exp(jnp.where(m, logp - batch["old_logp_BxT"], 0.0))
        a = batch["advantages_B"][:, None]
        surrogate = jnp.minimum(rho * a, jnp.clip(rho, 1 - EPS, 1 + EPS) * a)
        d = jnp.where(m, batch["ref_logp_BxT"] - logp, 0.0)
        kl = jnp.exp(d) - d - 1.0
        return jnp.sum(jnp.where(m, w_BxT * (-surrogate + KL_BETA * kl), 0.0))

    return jax.value_and_grad(loss)(params)


_PAPER_KEYS = ("prompt_tokens_BxP", "prompt_mask_BxP", "tokens_BxT", "completion_mask_BxT")
_PAPER_KEYS += ("old_logp_BxT", "ref_logp_BxT", "advantages_B")
_paper_jit = jax.jit(_paper_loss_and_grad)


def paper_loss_and_grad(params, batch, w_BxT):
    """_paper_loss_and_grad, compiled once: the batch narrowed to the arrays it reads (the tests'
    batches differ in the others, e.g. weights_BxT, which would make a program of their own)."""
    return _paper_jit(params, {k: batch[k] for k in _PAPER_KEYS}, w_BxT)


@pytest.mark.parametrize("preset", PRESETS)
def test_accumulated_gradient_is_the_full_batch_gradient(preset):
    params, batch = _setup(preset)
    ref_value, ref_grads = paper_loss_and_grad(params, batch, _paper_weights(preset, batch["completion_mask_BxT"]))
    for m in (1, 4):
        v, g, _ = _grad_fn(m)(params, batch)
        np.testing.assert_allclose(float(v), float(ref_value), rtol=1e-5, atol=1e-7)
        _assert_trees_close(g, ref_grads, rel=1e-5)


# ----------------------------------------------------------------------------- update step


def _adam_cfg(lr=0.05):
    return OptimConfig(learning_rate=lr, warmup_steps=0, end_lr_ratio=1.0, grad_clip=1.0)


@pytest.mark.slow
def test_update_step_ppo_epochs_record_old_logp_once():
    """ppo_epochs=2 with a high Adam lr: donation works, step counts, params move, and epoch 2 is
    taken against the log-probs recorded BEFORE epoch 1: the result equals two hand-rolled
    (grad, Adam) steps against those, and the epoch-2 ratios differ from 1 (with clipping)."""
    loss = _loss("grpo")
    opt = make_optimizer(_adam_cfg(), total_steps=10)
    step_fn = jax.jit(
        steps_lib.make_update_step(LOGP_FN, loss, opt, ppo_epochs=2, microbatches=2, max_new_tokens=T, group_size=G),
        donate_argnums=0,
    )
    params0 = _params()
    ref = _perturb(params0, 0.05, seed=3)
    batch = _batch()
    state = init_state(_copy(params0), opt, jax.random.key(0), ref_params=_copy(ref))
    state, metrics = step_fn(state, _rollout(batch))
    assert int(state.step) == 1
    assert all(np.isfinite(float(v)) for v in metrics.values())
    assert _max_abs(jax.tree.map(jnp.subtract, state.params, params0)) > 1e-3

    # By hand: old and ref recorded once from the starting params, then two epochs.
    hand = dict(
        batch,
        advantages_B=_advantages(loss, batch),
        weights_BxT=loss.weights(batch["completion_mask_BxT"], T),
        old_logp_BxT=_logp(params0, batch)[0],
        ref_logp_BxT=_logp(ref, batch)[0],
    )
    apply = jax.jit(lambda g, o, p: (lambda u, o: (optax.apply_updates(p, u), o))(*opt.update(g, o, p)))
    p, opt_state, sums, values, norms = params0, opt.init(params0), [], [], []
    for _ in range(2):
        v, g, s = _grad_fn(2)(p, hand)
        p, opt_state = apply(g, opt_state, p)
        sums.append(s), values.append(float(v)), norms.append(float(optax.tree.norm(g)))
    n = float(jnp.sum(batch["completion_mask_BxT"]))
    _assert_trees_close(state.params, p, rel=1e-4)
    np.testing.assert_allclose(float(metrics["loss"]), np.mean(values), rtol=1e-4)
    np.testing.assert_allclose(float(metrics["grad_norm"]), norms[0], rtol=1e-4)
    np.testing.assert_allclose(float(sums[0]["ratio_BxT"]["sum"]), n, rtol=1e-6)  # epoch 1: ratio 1
    expected_ratio = (float(sums[0]["ratio_BxT"]["sum"]) + float(sums[1]["ratio_BxT"]["sum"])) / 2 / n
    np.testing.assert_allclose(float(metrics["ratio"]), expected_ratio, rtol=1e-4)
    # Recording old log-probs again before epoch 2 would make every ratio 1 and every clip 0.
    assert abs(float(metrics["ratio"]) - 1.0) > 1e-2
    assert float(metrics["clipped_low"]) + float(metrics["clipped_high"]) > 0

    state, _ = step_fn(state, _rollout(batch))  # the returned (donated-into) state is usable again
    assert int(state.step) == 2


SGD_LR = 0.3


@functools.cache
def _sgd_step():
    """One PPO epoch (old = current), plain SGD, 2 microbatches, a reference but no KL in the loss
    (use_ref=True: the reference forward only for the `kl` metric)."""
    opt = optax.sgd(SGD_LR)
    step = jax.jit(
        steps_lib.make_update_step(
            LOGP_FN,
            _loss("grpo", kl_beta=0.0),
            opt,
            ppo_epochs=1,
            microbatches=2,
            max_new_tokens=T,
            group_size=G,
            use_ref=True,
        ),
        donate_argnums=0,
    )
    return opt, step


def _run_sgd_step(params, batch, ref_params=None):
    opt, step = _sgd_step()
    ref_params = params if ref_params is None else ref_params
    state = init_state(_copy(params), opt, jax.random.key(0), ref_params=_copy(ref_params))
    return step(state, _rollout(batch))


def test_one_epoch_update_is_an_sgd_step_along_the_policy_gradient():
    """ppo_epochs=1: ratio exactly 1, no clipping, and the applied update is -lr times the
    full-batch policy gradient -sum_i,t w_it A_i grad logp_it written out here."""
    params = _params()
    batch = _batch()
    state, metrics = _run_sgd_step(params, batch)
    assert int(state.step) == 1
    assert float(metrics["ratio"]) == 1.0
    assert float(metrics["clipped_low"]) == 0.0 and float(metrics["clipped_high"]) == 0.0
    w = _paper_weights("grpo", batch["completion_mask_BxT"])
    a = _advantages(_loss("grpo"), batch)[:, None]
    # The paper loss at ratio 1 (old = current log-probs as data) and zero KL (ref = current): its
    # gradient is the policy gradient. The arrays it reads have _setup's shapes: no new program to compile.
    logp = _logp(params, batch)[0]
    on_policy = dict(batch, advantages_B=a[:, 0], old_logp_BxT=logp, ref_logp_BxT=logp)
    value, pg = paper_loss_and_grad(params, on_policy, w)
    np.testing.assert_allclose(float(value), -float(jnp.sum(w * a)), rtol=1e-5, atol=1e-7)
    applied = jax.tree.map(lambda new, old: (old - new) / SGD_LR, state.params, params)
    _assert_trees_close(applied, pg, rel=1e-4)
    np.testing.assert_allclose(float(metrics["loss"]), -float(jnp.sum(w * a)), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(optax.tree.norm(pg)), rtol=1e-4)
    # entropy metric: masked token mean at the pre-update params
    mask = batch["completion_mask_BxT"]
    entropy = _logp(params, batch)[1]
    np.testing.assert_allclose(float(metrics["entropy"]), float(jnp.sum(entropy * mask) / jnp.sum(mask)), rtol=1e-5)


def test_kl_metric_is_zero_against_itself_and_positive_after_params_change():
    params = _params()
    batch = _batch()
    _, metrics = _run_sgd_step(params, batch)  # reference == policy
    assert abs(float(metrics["kl"])) < 1e-6
    ref = _perturb(params, 0.05, seed=7)
    _, metrics = _run_sgd_step(params, batch, ref_params=ref)
    # masked token mean of k3(logp, ref_logp), by hand
    m = batch["completion_mask_BxT"]
    d = _logp(ref, batch)[0] - _logp(params, batch)[0]
    expected = float(jnp.sum(jnp.where(m > 0, jnp.exp(d) - d - 1.0, 0.0)) / jnp.sum(m))
    assert expected > 1e-4
    np.testing.assert_allclose(float(metrics["kl"]), expected, rtol=1e-3)


def test_sgd_step_moves_logprobs_in_the_sign_of_the_advantage():
    # groups of 2 with rewards (1, 0) or (0, 1): A = +-1 (any std convention), row 2 is empty
    rewards = np.array([[1, 0], [0, 0], [1, 0], [0, 0], [0, 1], [0, 0], [0, 0], [1, 0]], np.float32)
    adv = np.array([1.0, -1.0, 1.0, -1.0, 1.0, -1.0, -1.0, 1.0], np.float32)
    params = _params()
    batch = _batch(seed=5, rewards=rewards)
    np.testing.assert_allclose(np.sign(_advantages(_loss("grpo"), batch)), adv)
    state, _ = _run_sgd_step(params, batch)
    m = batch["completion_mask_BxT"]
    before = jnp.sum(_logp(params, batch)[0] * m, axis=1)
    after = jnp.sum(_logp(state.params, batch)[0] * m, axis=1)
    delta = np.asarray(after - before)
    pos, neg = adv > 0, (adv < 0) & (LENGTHS > 0)
    assert delta[pos].sum() > 1e-3
    assert delta[neg].sum() < -1e-3


# ----------------------------------------------------------------------------- optimizer, schedule


def test_learning_rate_schedule_warmup_peak_and_decay():
    lr = 1e-2
    cfg = OptimConfig(learning_rate=lr, warmup_steps=4, end_lr_ratio=0.1)
    s = jax.jit(learning_rate_schedule(cfg, total_steps=20))  # one program, not one per op
    vals = np.asarray(s(jnp.arange(26)), np.float64)
    assert vals[0] == 0.0
    np.testing.assert_allclose(vals[:5], [0, lr / 4, lr / 2, 3 * lr / 4, lr], rtol=1e-6)
    assert vals.max() == pytest.approx(lr) and int(np.argmax(vals)) == 4
    assert np.all(np.diff(vals[4:21]) < 0)  # strictly decreasing after the peak
    np.testing.assert_allclose(vals[12], 0.1 * lr + 0.9 * lr / 2, rtol=1e-5)  # cosine midpoint
    np.testing.assert_allclose(vals[20:], 0.1 * lr, rtol=1e-6)  # end value, and it stays there
    # decay_steps overrides total_steps; no warm-up starts at the peak
    s = jax.jit(learning_rate_schedule(OptimConfig(lr, warmup_steps=0, decay_steps=8, end_lr_ratio=0.5), 100))
    np.testing.assert_allclose(s(jnp.array([0, 8, 50])), [lr, 0.5 * lr, 0.5 * lr], rtol=1e-6)


def test_optimizer_clips_by_global_norm():
    clip = 0.5
    cfg = OptimConfig(learning_rate=1e-2, warmup_steps=0, end_lr_ratio=1.0, grad_clip=clip)
    rng = np.random.default_rng(0)
    params = {"a": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), "b": jnp.asarray(rng.normal(size=5), jnp.float32)}

    def direction():
        g = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
        return jax.tree.map(lambda x: x / optax.tree.norm(g), g)

    unit, other = direction(), direction()

    def scaled(c, t):
        return jax.tree.map(lambda x: c * x, t)

    def updater(opt):
        """Adam's first step is scale-invariant, so also take a second step in another direction:
        the moments remember how big the first gradient was."""

        def two(first):
            state = opt.init(params)
            u1, state = opt.update(first, state, params)
            u2, _ = opt.update(scaled(clip, other), state, params)
            return u1, u2

        return jax.jit(two)

    clipped = updater(make_optimizer(cfg, total_steps=10))
    unclipped = updater(optax.adamw(1e-2, b1=cfg.b1, b2=cfg.b2, weight_decay=0.0))
    # a gradient of global norm 1e4 acts exactly like the same gradient rescaled to norm grad_clip
    huge = clipped(scaled(1e4, unit))
    _assert_trees_close(huge, clipped(scaled(clip, unit)), rel=1e-5)
    # below the threshold nothing is rescaled: the same as AdamW without the clip
    below = scaled(0.5 * clip, unit)
    _assert_trees_close(clipped(below), unclipped(below), rel=1e-5)
    # sensitivity: without the clip the huge first gradient changes the second update a lot
    diff = jax.tree.map(jnp.subtract, unclipped(scaled(1e4, unit))[1], huge[1])
    assert _max_abs(diff) > 0.2 * _max_abs(huge[1])
