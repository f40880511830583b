"""Speculative rollouts: greedy equality, the exact sampled distribution (chi-square against brute-force
enumeration), recorded log-probs, and that a wrong acceptance rule is caught."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from chi_square import chi_square_pvalue

from jaxrl.config import ConfigError, ModelConfig, SpeculativeConfig
from jaxrl.models import transformer as tf
from jaxrl.rollout.sampler import SamplingParams, sample
from jaxrl.rollout.speculative import acceptance
from jaxrl.rollout.speculative.calibrate import StepCosts, constant_costs
from jaxrl.rollout.speculative.drafters import dequantize, quantize_int8
from jaxrl.rollout.speculative.reuse import DraftStore
from jaxrl.rollout.speculative.sample import sample_speculative, worth_speculating
from jaxrl.rollout.speculative.steps import choose_draft_length as _choose_draft_length

CFG = ModelConfig(vocab_size=29, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
MOE = dataclasses.replace(CFG, n_experts=4, experts_per_token=2, expert_mlp_dim=32)
PAD, EOS = 0, 7
SAMPLING = ("temperature", "top_k", "top_p", "greedy", "max_new_tokens", "eos_id", "pad_id")  # SamplingParams
P, T = 5, 6


@functools.cache
def _params(cfg=CFG, scale=1.0):
    params = tf.init_params(cfg, jax.random.PRNGKey(0))
    # A larger embedding (tied head) makes the next-token distributions peaked, like a trained policy.
    return dict(params, embedding=params["embedding"] * scale)


def _prompts(lengths=(2, 5, 4), seed=1):
    toks = np.random.default_rng(seed).integers(1, CFG.vocab_size, (len(lengths), P), dtype=np.int32)
    mask = np.zeros((len(lengths), P), np.int32)
    for i, n in enumerate(lengths):
        mask[i, P - n :] = 1
    return jnp.asarray(np.where(mask, toks, PAD)), jnp.asarray(mask)


def _spec(drafter, **kw):
    return SpeculativeConfig(enabled=True, drafter=drafter, max_active_rows=1 << 20, **kw)


def _run(params, cfg, spec, rng, draft=None, **kw):
    """sample_speculative over _prompts(). The costs and the acceptance prior are always passed (the
    configured ones by default): traced arguments, so the tests that differ only in them (the greedy
    and the cost tests, at the same spec) share one compiled program."""
    prompt, pmask = _prompts()
    extra = {} if draft is None else dict(draft_NxT=draft[0], draft_len_N=draft[1])
    args = dict(group_size=2, max_new_tokens=T, temperature=1.0, eos_id=EOS, pad_id=PAD)
    args.update(costs=constant_costs(spec), acceptance_prior=jnp.float32(spec.initial_acceptance))
    args.update(kw)
    args["sampling"] = SamplingParams(**{k: args.pop(k) for k in SAMPLING if k in args})
    return sample_speculative(params, cfg, prompt, pmask, rng, spec=spec, **args, **extra)


def _plain(params, cfg, rng, **kw):
    prompt, pmask = _prompts()
    args = dict(group_size=2, max_new_tokens=T, temperature=1.0, eos_id=EOS, pad_id=PAD)
    args.update(kw)
    args["sampling"] = SamplingParams(**{k: args.pop(k) for k in SAMPLING if k in args})
    return sample(params, cfg, prompt, pmask, rng, **args)


# Two specs per drafter: a fixed draft length for the greedy test (greedy=True), the adaptive control
# for the sampled tests (the cost, temperature-zero and log-prob tests, greedy=False). The same static
# arguments, so the programs compiled by one test are reused by the next (each costs seconds); the
# temperature, the costs and the acceptance prior are traced.
W = 3  # drafted tokens per verify forward (self and reuse): a window of 4 < T, so rows take several


def _fixed(drafter):
    return _spec(drafter, max_draft=W, adaptive=False, reuse_width=W)


def _adaptive(drafter):
    return _spec(drafter, max_draft=W, reuse_width=W)


def _cheap():
    """Costs and prior under which the adaptive control drafts: a verify step as dear as a plain one,
    a drafted token 1/20 of one, acceptance 0.9 expected."""
    return dict(costs=StepCosts(jnp.full((W,), 1.0, jnp.float32), jnp.float32(0.05)), acceptance_prior=jnp.float32(0.9))


@pytest.mark.slow
@pytest.mark.parametrize(
    "cfg,drafter",
    [(CFG, "early_exit"), (CFG, "int8"), (MOE, "int8"), (CFG, "reuse"), (MOE, "reuse")],
    ids=["early_exit", "int8", "moe-int8", "reuse", "moe-reuse"],
)
def test_greedy_equals_plain_greedy(cfg, drafter):
    """Temperature 0: every drafter gives exactly the plain greedy tokens, masks, lengths and (MoE)
    routing; log-probs agree to float32 noise. Reuse is tried with the right completion as the draft
    (accepted whole: no rejection, every verify step keeps its full window of W drafts + 1) and with
    a corrupted one (a wrong token in the middle)."""
    params = _params(cfg, 3.0)
    ref = _plain(params, cfg, jax.random.PRNGKey(0), greedy=True)
    drafts = [None]
    if drafter == "reuse":
        bad = np.asarray(ref.tokens_BxT).copy()
        bad[:, 1] = (bad[:, 1] + 1) % cfg.vocab_size
        drafts = [(ref.tokens_BxT, ref.length_B), (jnp.asarray(bad), ref.length_B)]
    for i, draft in enumerate(drafts):
        out, stats = _run(params, cfg, _fixed(drafter), jax.random.PRNGKey(0), draft, greedy=True)
        np.testing.assert_array_equal(out.tokens_BxT, ref.tokens_BxT)
        np.testing.assert_array_equal(out.completion_mask_BxT, ref.completion_mask_BxT)
        np.testing.assert_array_equal(out.length_B, ref.length_B)
        np.testing.assert_array_equal(out.finished_B, ref.finished_B)
        np.testing.assert_allclose(out.logp_BxT, ref.logp_BxT, atol=1e-5)
        if cfg.n_experts:
            # Left-padding slots attend to nothing real: their (unused) routing depends on the cache length.
            pmask = np.repeat(np.asarray(_prompts()[1], bool), 2, axis=0)
            live = np.concatenate([pmask[:, : P - 1], np.asarray(ref.completion_mask_BxT, bool)], 1)
            np.testing.assert_array_equal(
                np.asarray(out.routing_BxSxLxK)[:, : P - 1 + T][live],
                np.asarray(ref.routing_BxSxLxK)[:, : P - 1 + T][live],
            )
        assert int(stats.drafted) > 0 and int(stats.self_steps) + int(stats.reuse_steps) > 0
        if drafter == "reuse" and i == 0:  # the right draft: one verify step per W + 1 tokens of the longest row
            assert int(stats.rejections) == 0, stats
            assert int(out.num_steps) == -(-int(np.max(ref.length_B)) // (W + 1)) == 2, int(out.num_steps)
        if drafter == "reuse" and i == 1:
            assert int(stats.rejections) > 0


@pytest.mark.slow
def test_costs_decide_whether_to_speculate():
    """With (measured) costs under which no draft length pays, the adaptive loop never speculates;
    with cheap ones it does. Either way the tokens are the plain greedy ones: the adaptive runs sample
    at temperature 0 (the programs of the temperature-zero test below, whose tokens are the greedy
    ones), the control-off run is greedy (the greedy test's program)."""
    params = _params(CFG, 3.0)
    plain = _plain(params, CFG, jax.random.PRNGKey(0), greedy=True)
    for verify, draft, speculates in ((4.0, 1.0, False), (1.0, 0.05, True)):
        costs = StepCosts(jnp.full((W,), verify, jnp.float32), jnp.float32(draft))
        out, stats = _run(
            params,
            CFG,
            _adaptive("early_exit"),
            jax.random.PRNGKey(0),
            temperature=0.0,
            costs=costs,
            acceptance_prior=jnp.float32(0.9),
        )
        assert (int(stats.self_steps) > 0) == speculates
        np.testing.assert_array_equal(out.tokens_BxT, plain.tokens_BxT)
    # Reuse too: a reused draft is verified only while that is expected to beat a plain step, unless
    # the control is off.
    draft = (plain.tokens_BxT, plain.length_B)
    for verify, adaptive, reuses in ((1.0, True, True), (8.0, True, False), (8.0, False, True)):
        costs = StepCosts(jnp.full((W,), verify, jnp.float32), jnp.float32(0.5))
        spec, how = (_adaptive("reuse"), dict(temperature=0.0)) if adaptive else (_fixed("reuse"), dict(greedy=True))
        out, stats = _run(params, CFG, spec, jax.random.PRNGKey(0), draft=draft, costs=costs, **how)
        assert (int(stats.reuse_steps) > 0) == reuses, (verify, adaptive)
        np.testing.assert_array_equal(out.tokens_BxT, plain.tokens_BxT)


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["early_exit", "reuse"])
def test_temperature_zero_without_greedy_flag(drafter):
    """temperature=0 without greedy=True runs the rejection-sampling path against the T -> 0 limit
    distribution (a point mass on the argmax): the plain greedy tokens, log-probs 0, nothing NaN. The
    costs are cheap enough that the adaptive control drafts."""
    params = _params(CFG, 3.0)
    ref = _plain(params, CFG, jax.random.PRNGKey(0), greedy=True)
    draft = (ref.tokens_BxT, ref.length_B) if drafter == "reuse" else None
    out, stats = _run(params, CFG, _adaptive(drafter), jax.random.PRNGKey(5), draft, temperature=0.0, **_cheap())
    assert int(stats.drafted) > 0
    np.testing.assert_array_equal(out.tokens_BxT, ref.tokens_BxT)
    np.testing.assert_array_equal(np.asarray(out.logp_BxT), np.zeros(out.logp_BxT.shape, np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [CFG, MOE], ids=["dense", "moe"])
def test_recorded_logprobs_equal_trainer_recomputation(cfg):
    """Sampled at temperature 0.7: the log-probs the speculative sampler records equal
    `token_logprobs` over the same tokens (MoE: replaying the recorded routing)."""
    params = _params(cfg, 2.0)
    prompt, pmask = _prompts()
    for drafter in ("early_exit",):  # the int8 drafter's tokens are checked by the greedy and chi-square tests
        # The temperature is traced: on the dense model this is the program of the test above.
        out, stats = _run(params, cfg, _adaptive(drafter), jax.random.PRNGKey(3), temperature=0.7, **_cheap())
        assert int(stats.drafted) > 0

        def rows(x):
            return jnp.repeat(x, 2, axis=0)

        logp, _ = tf.token_logprobs(
            params,
            cfg,
            rows(prompt),
            rows(pmask),
            out.tokens_BxT,
            out.completion_mask_BxT,
            0.7,
            replay_BxSxLxK=out.routing_BxSxLxK,
        )
        mask = np.asarray(out.completion_mask_BxT) > 0
        assert mask.sum() > 6
        np.testing.assert_allclose(np.asarray(out.logp_BxT)[mask], np.asarray(logp)[mask], atol=2e-5)
        assert np.all(np.asarray(out.logp_BxT)[~mask] == 0)


# --- the sampled distribution, against enumeration --------------------------------------------

SMALL = ModelConfig(vocab_size=5, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, mlp_dim=32)
S_EOS, S_T, S_P = 1, 3, 3
N_SAMPLES = 12000


def _small_prompt():
    return jnp.asarray([[2, 4, 3]], jnp.int32), jnp.ones((1, S_P), jnp.int32)


@functools.cache
def _exact_distribution(temperature, top_k):
    """{completion tuple (up to and including EOS): probability} by brute force: the probability of
    every length-T token string under the plain sampler's per-step distribution, cut at EOS."""
    params = _small_params()
    prompt, _ = _small_prompt()
    V = SMALL.vocab_size
    strings = np.array(list(itertools.product(range(V), repeat=S_T)), np.int32)
    seq = np.concatenate([np.repeat(np.asarray(prompt), len(strings), 0), strings], 1)
    logits = np.asarray(tf.forward(params, SMALL, seq, np.ones_like(seq)))[:, S_P - 1 : S_P - 1 + S_T]
    # Jitted: eager dispatch would compile each of target_probs' primitives on its own.
    probs = np.asarray(jax.jit(acceptance.target_probs, static_argnums=(2, 3))(logits, temperature, top_k, 1.0))
    dist = {}
    for s, p in zip(strings, probs):
        n = next((i + 1 for i, t in enumerate(s) if t == S_EOS), S_T)
        key = tuple(int(t) for t in s[:n])
        if key not in dist:
            dist[key] = float(np.prod([p[i, s[i]] for i in range(n)]))
    assert abs(sum(dist.values()) - 1) < 1e-4
    return dist


def _chi_square_pvalue(tokens, mask, dist):
    return chi_square_pvalue(
        [tuple(int(t) for t in row[m > 0]) for row, m in zip(np.asarray(tokens), np.asarray(mask))], dist
    )


def _sample_small(params, spec, temperature, top_k, seed, draft=None, sampler=sample_speculative):
    prompt, pmask = _small_prompt()
    extra = {}
    if draft is not None:
        d = jnp.broadcast_to(jnp.asarray(draft, jnp.int32), (N_SAMPLES, S_T))
        extra = dict(draft_NxT=d, draft_len_N=jnp.full((N_SAMPLES,), len(draft), jnp.int32))
    out, stats = sampler(
        params,
        SMALL,
        prompt,
        pmask,
        jax.random.PRNGKey(seed),
        spec=spec,
        group_size=N_SAMPLES,
        sampling=SamplingParams(max_new_tokens=S_T, temperature=temperature, top_k=top_k, eos_id=S_EOS, pad_id=PAD),
        **extra,
    )
    return out, stats


def _small_params():
    return _params(SMALL, 1.5)


@pytest.fixture(scope="module")
def small_params():
    return _small_params()


# (drafter, temperature, top_k, reuse draft). Each case is a compile of its own (top_k and the spec
# are static), so the set covers each path once: a self-drafter with temperature and top-k (q and p
# both truncated, the residual between them), a self-drafter untruncated at temperature 1 (int8: the
# same self-draft code as early exit, over the quantized view), and point-mass reuse drafts.
CASES = [
    ("early_exit", 0.8, 3, None),
    ("int8", 1.0, 0, None),
    ("reuse", 1.0, 0, (3, 3, 1)),
]


@pytest.mark.slow
@pytest.mark.parametrize("drafter,temperature,top_k,draft", CASES)
def test_sampled_distribution_equals_enumeration(small_params, drafter, temperature, top_k, draft):
    """12,000 speculative samples of 3-token completions (vocab 5, EOS inside it) against the exact
    distribution by enumeration: chi-square p-value > 1e-3 (fixed seed). The drafts must really be
    tested: a good share of them is rejected and a good share accepted."""
    spec = _spec(drafter, max_draft=2, adaptive=False, reuse_width=3)
    out, stats = _sample_small(small_params, spec, temperature, top_k, seed=11, draft=draft)
    pvalue, df = _chi_square_pvalue(out.tokens_BxT, out.completion_mask_BxT, _exact_distribution(temperature, top_k))
    assert df >= 8
    assert pvalue > 1e-3, (drafter, pvalue)
    drafted, accepted = int(stats.drafted), int(stats.accepted)
    assert drafted > 1000 and 0.05 < accepted / drafted < (1.0 if drafter == "int8" else 0.95), (accepted, drafted)


_RIGHT_RULE = acceptance.verify_sampled


def _wrong_residual(rng, p, draft, drafted, q=None, approx_old_logp_NxW=None):
    """A classic bug: at a rejection, draw from p instead of normalise(max(0, p - q))."""
    a, _ = _RIGHT_RULE(rng, p, draft, drafted, q)
    p_a = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]
    return acceptance.Verdict(a, acceptance.categorical(jax.random.fold_in(rng, 1), p_a))


def _retraced_sampler():
    """sample_speculative's body under a new jit (its own, empty trace cache): traced with whatever
    acceptance rule is patched in now, without flushing jax's caches (jax.clear_caches() made every
    later test on this worker compile its programs again)."""
    body = sample_speculative.__wrapped__.__wrapped__  # temperature_checked(jax.jit(body))

    @functools.wraps(body)  # body's signature: `cfg`, passed by position, is found static by name
    def retraced(*args, **kwargs):
        return body(*args, **kwargs)

    static = ("cfg", "spec", "group_size")
    return jax.jit(retraced, static_argnames=static)


@pytest.mark.slow
@pytest.mark.parametrize("drafter,temperature,top_k,draft", CASES[:1])
def test_chi_square_catches_a_wrong_acceptance_rule(small_params, monkeypatch, drafter, temperature, top_k, draft):
    """The same test (its first case) with the residual replaced by p (the most common
    speculative-sampling bug) fails by a wide margin: the test has the power to tell a wrong rule
    from the right one."""
    monkeypatch.setattr(acceptance, "verify_sampled", _wrong_residual)
    try:
        spec = _spec(drafter, max_draft=2, adaptive=False, reuse_width=3)
        out, _ = _sample_small(small_params, spec, temperature, top_k, 11, draft, sampler=_retraced_sampler())
    finally:
        monkeypatch.undo()
    pvalue, _ = _chi_square_pvalue(out.tokens_BxT, out.completion_mask_BxT, _exact_distribution(temperature, top_k))
    assert pvalue < 1e-6, pvalue


# --- pieces -----------------------------------------------------------------------------------


def test_point_mass_verification_by_hand():
    """Reused draft tokens d1=1, d2=2 against p rows: accept d1 w.p. p0(1) = 0.9, d2 w.p. p1(2) = 0.25; at a
    rejection of d2 the draw excludes token 2. Frequencies over 40,000 rows match the hand numbers."""
    p = jnp.asarray([[0.05, 0.9, 0.05], [0.5, 0.25, 0.25], [0.2, 0.3, 0.5]], jnp.float32)
    n = 40000
    p_NxWxV = jnp.broadcast_to(p, (n, 3, 3))
    draft = jnp.broadcast_to(jnp.asarray([0, 1, 2]), (n, 3))
    drafted = jnp.broadcast_to(jnp.asarray([False, True, True]), (n, 3))
    # Jitted, as the samplers run it: eager dispatch compiles each primitive on its own (several x slower).
    a, new = jax.jit(acceptance.verify_sampled)(jax.random.PRNGKey(0), p_NxWxV, draft, drafted)
    a, new = np.asarray(a), np.asarray(new)
    np.testing.assert_allclose(np.mean(a == 0), 0.1, atol=0.01)
    np.testing.assert_allclose(np.mean(a == 1), 0.9 * 0.75, atol=0.01)
    np.testing.assert_allclose(np.mean(a == 2), 0.9 * 0.25, atol=0.01)
    assert not np.any(new[a == 1] == 2)  # token 2 was just rejected there
    np.testing.assert_allclose(np.mean(new[a == 1] == 0), 0.5 / 0.75, atol=0.015)
    np.testing.assert_allclose(np.mean(new[a == 0] == 0), 0.05 / 0.1, atol=0.03)  # p0 without token 1
    np.testing.assert_allclose(np.mean(new[a == 2] == 2), 0.5, atol=0.015)  # bonus from p2


def test_draft_length_choice():
    """Expected tokens per cost (1 - r^(k+1)) / (1 - r) / (1 + k c): at r=0.9, c=0.5 the best k is 3
    (rates 1.267, 1.355, 1.3756, 1.3686); at r=0.3 no k beats a plain step (k=1: 1.3 / 1.5 < 1)."""
    # Jitted, as the loop runs it: two programs (adaptive on, off) instead of every primitive eagerly.
    choose_draft_length = jax.jit(_choose_draft_length, static_argnums=(1, 3))
    k, gain = choose_draft_length(jnp.float32(0.9), 4, 0.5, True)
    assert int(k) == 3 and abs(float(gain) - (1 - 0.9**4) / 0.1 / 2.5) < 1e-5
    k, gain = choose_draft_length(jnp.float32(0.3), 4, 0.5, True)
    assert int(k) == 1 and float(gain) < 1
    assert int(choose_draft_length(jnp.float32(0.3), 4, 0.5, False)[0]) == 4
    # A verify step costing 3 plain steps (this CPU): even at r=0.9 the best, k=4, gives 4.0951/5 < 1.
    k, gain = choose_draft_length(jnp.float32(0.9), 4, 0.5, True, verify_cost=3.0)
    assert int(k) == 4 and abs(float(gain) - (1 - 0.9**5) / 0.1 / 5.0) < 1e-5


def test_worth_speculating_by_hand():
    """Before a rollout: self-drafting at r=0.9 with k=3 gives (1 - 0.9^4) / 0.1 / (1 + 3 x 0.5) =
    1.3756 tokens per step-cost at verify cost 1, but at verify cost 3 its best, k=4, gives
    (1 - 0.9^5) / 0.1 / (3 + 4 x 0.5) = 0.819; reuse (window 4) at r=0.7 with full drafts and verify
    cost 2 gives (1 - 0.7^5) / 0.3 / 2 = 1.387, at verify cost 3 0.924, with half the rows drafting
    2 tokens and half none (2.19 / 2 + 1 / 2) / 2 = 0.7975, and nothing without drafts."""
    ee = SpeculativeConfig(enabled=True, drafter="early_exit", max_draft=4)
    cheap, dear = (StepCosts(jnp.full((4,), v, jnp.float32), jnp.float32(0.5)) for v in (1.0, 3.0))
    assert worth_speculating(cheap, ee, 0.9, 0.0) and not worth_speculating(dear, ee, 0.9, 0.0)
    assert worth_speculating(dear, dataclasses.replace(ee, adaptive=False), 0.9, 0.0)
    reuse = SpeculativeConfig(enabled=True, drafter="reuse", reuse_width=4, max_draft=2)
    two, three = (StepCosts(jnp.full((4,), v, jnp.float32), jnp.float32(0.5)) for v in (2.0, 3.0))
    full, half, none = np.array([6, 9]), np.array([2, 0]), np.zeros(2, int)
    assert worth_speculating(two, reuse, 0.0, 0.7, full) and not worth_speculating(three, reuse, 0.0, 0.7, full)
    one = StepCosts(jnp.full((4,), 1.0, jnp.float32), jnp.float32(0.5))
    assert worth_speculating(one, reuse, 0.0, 0.7, half) and not worth_speculating(two, reuse, 0.0, 0.7, half)
    assert not worth_speculating(one, reuse, 0.0, 0.7, none) and not worth_speculating(one, reuse, 0.0, 0.7)


@pytest.mark.slow
def test_int8_view_is_close_and_int8():
    params = _params()
    # Jitted, as the int8 drafter runs them (inside the sampler's program): eager dispatch would
    # compile every primitive for every leaf shape.
    q = jax.jit(quantize_int8)(params)
    assert q["blocks"]["mlp"]["gate"].values.dtype == jnp.int8
    for a, b in zip(jax.tree.leaves(jax.jit(dequantize)(q)), jax.tree.leaves(params)):
        assert a.shape == b.shape
        b = np.asarray(b)  # the bound in numpy: eager jnp would compile max(abs) for every leaf shape
        np.testing.assert_allclose(a, b, atol=float(np.max(np.abs(b))) / 127 * 0.51 + 1e-7)


def test_speculative_config_errors_name_the_field():
    from jaxrl.config import Config, override

    with pytest.raises(ConfigError, match=r"rollout\.speculative\.drafter"):
        override(Config(), "rollout.speculative.drafter", "medusa").validate()
    with pytest.raises(ConfigError, match=r"rollout\.speculative\.max_draft"):
        override(Config(), "rollout.speculative.max_draft", "0").validate()
    with pytest.raises(ValueError, match=r"draft_layers"):
        _run(_params(), CFG, _spec("early_exit", draft_layers=2), jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"draft_NxT"):
        _run(_params(), CFG, _spec("reuse"), jax.random.PRNGKey(0))


def test_spec_rl_rule_accepts_drafts_the_old_policy_rated_like_the_new():
    """The approximate SPEC-RL rule accepts with min(1, p / q_old): given q_old = p (the drafts' own
    log-probs under this policy) every drafted token is accepted, where the exact point-mass rule
    accepts each only with probability p(x) < 1. The drafts are a sample at temperature 1 (from the
    sampled tests' program: the same distribution as the plain sampler's, log-probs recorded alike)."""
    params = _params(CFG, 2.0)
    first, _ = _run(params, CFG, _adaptive("early_exit"), jax.random.PRNGKey(5), **_cheap())
    draft = (first.tokens_BxT, first.length_B)
    prompt, pmask = _prompts()
    out, stats = sample_speculative(
        params,
        CFG,
        prompt,
        pmask,
        jax.random.PRNGKey(6),
        spec=_spec("reuse", reuse_width=T, reuse_rule="spec_rl"),
        group_size=2,
        sampling=SamplingParams(max_new_tokens=T, temperature=1.0, eos_id=EOS, pad_id=PAD),
        draft_NxT=draft[0],
        draft_len_N=draft[1],
        draft_logp_NxT=first.logp_BxT,
    )
    assert int(stats.drafted) > 0 and int(stats.accepted) == int(stats.drafted)
    np.testing.assert_array_equal(out.tokens_BxT, first.tokens_BxT)  # every draft kept, EOS included


def test_draft_store_returns_each_prompts_last_completions():
    """Lookup gives row i*G+g completion g of prompt i's last update (matched on its real tokens, not
    its padding), zeros for an unseen prompt; the least recently used prompt is dropped past the cap."""
    store = DraftStore(max_prompts=2)
    prompts = np.array([[0, 5, 6], [7, 8, 9], [0, 0, 4]], np.int32)
    masks = prompts > 0
    toks = np.arange(1, 13, dtype=np.int32).reshape(6, 2)  # 3 prompts x G=2 rows, T=2
    store.update(prompts[:2], masks[:2], toks[:4], np.array([2, 1, 2, 0]), np.ones((4, 2), np.float32), 2)
    padded_differently = np.array([[5, 6, 0]], np.int32)  # same real tokens, other padding column
    d, n, lp = store.lookup(
        np.concatenate([prompts[1:2], padded_differently]),
        np.concatenate([masks[1:2], padded_differently > 0]),
        2,
        3,
        PAD,
    )
    np.testing.assert_array_equal(d[:, :2], [[5, 6], [7, 8], [1, 2], [3, 4]])
    np.testing.assert_array_equal(n, [2, 0, 2, 1])
    assert d.shape == (4, 3) and np.all(d[:, 2] == PAD) and lp[0, 0] == 1.0
    d, n, _ = store.lookup(prompts[2:], masks[2:], 2, 2, PAD)
    assert np.all(n == 0) and np.all(d == PAD)
    store.update(prompts[2:], masks[2:], toks[4:], np.array([1, 1]), np.zeros((2, 2), np.float32), 2)
    assert len(store) == 2  # prompt 1 was looked up before prompt 0, so it is the one dropped
    assert np.all(store.lookup(prompts[1:2], masks[1:2], 2, 2, PAD)[1] == 0)
    np.testing.assert_array_equal(store.lookup(prompts[:1], masks[:1], 2, 2, PAD)[1], [2, 1])
