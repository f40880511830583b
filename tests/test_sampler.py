import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import ModelConfig
from jaxrl.models import transformer as tf
from jaxrl.rollout.sampler import SamplingParams, sample

CFG = ModelConfig(vocab_size=29, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
NEVER = CFG.vocab_size  # an eos id the model can never emit
PAD = 0
P, T = 5, 6


@functools.cache
def _params(cfg=CFG):
    return tf.init_params(cfg, jax.random.PRNGKey(0))


def _prompts(lengths=(2, 5, 4), seed=1, vocab=CFG.vocab_size):
    toks = np.random.default_rng(seed).integers(1, vocab, (len(lengths), P), dtype=np.int32)
    mask = np.zeros((len(lengths), P), np.int32)
    for i, n in enumerate(lengths):
        mask[i, P - n :] = 1
    return jnp.asarray(np.where(mask, toks, PAD)), jnp.asarray(mask)


def _greedy(eos_id, group_size=1, **kw):
    prompt, pmask = _prompts()
    return sample(
        _params(),
        CFG,
        prompt,
        pmask,
        jax.random.PRNGKey(0),
        group_size=group_size,
        sampling=SamplingParams(max_new_tokens=T, temperature=1.0, eos_id=eos_id, pad_id=PAD, greedy=True),
        **kw,
    )


def _check_oracle(out, eos_id, group_size):
    """Python-loop oracle: every generated token is the argmax of a full no-cache forward over
    prompt + the tokens generated so far. The sequence is right-filled with pad to a fixed width
    and fed in blocks of 3 rows (whatever the group size) so `forward` compiles once; causality
    makes slots after the query irrelevant."""
    prompt, pmask = (np.repeat(np.asarray(x), group_size, axis=0) for x in _prompts())
    B, block = prompt.shape[0], len(_prompts()[0])
    tokens, mask = np.asarray(out.tokens_BxT), np.asarray(out.completion_mask_BxT)
    for t in range(T):  # numpy inputs: eager jnp slicing would compile a kernel per step
        gen = np.where(np.arange(T) < t, tokens, PAD)
        gen_mask = np.broadcast_to(np.arange(T) < t, (B, T)).astype(np.int32)
        seq, seq_mask = np.concatenate([prompt, gen], 1), np.concatenate([pmask, gen_mask], 1)
        logits_BxV = np.concatenate(
            [
                np.asarray(tf.forward(_params(), CFG, seq[i : i + block], seq_mask[i : i + block]))
                for i in range(0, B, block)
            ]
        )[:, P - 1 + t]
        want = np.argmax(logits_BxV, -1)
        live = mask[:, t] == 1
        np.testing.assert_array_equal(tokens[live, t], want[live], err_msg=f"step {t}")
    _check_eos_layout(out, eos_id, PAD)


def _check_eos_layout(out, eos_id, pad_id):
    tokens, mask = np.asarray(out.tokens_BxT), np.asarray(out.completion_mask_BxT)
    logp, length, finished = np.asarray(out.logp_BxT), np.asarray(out.length_B), np.asarray(out.finished_B)
    n_cols = tokens.shape[1]
    for r in range(tokens.shape[0]):
        hits = np.flatnonzero(tokens[r] == eos_id)
        n = hits[0] + 1 if len(hits) else n_cols
        assert finished[r] == (len(hits) > 0)
        assert length[r] == n
        np.testing.assert_array_equal(mask[r], (np.arange(n_cols) < n).astype(np.float32))
        assert np.all(tokens[r, n:] == pad_id) and np.all(logp[r, n:] == 0.0)
        assert np.all(logp[r, :n] < 0.0)
    assert out.tokens_BxT.dtype == jnp.int32 and out.completion_mask_BxT.dtype == jnp.float32
    assert out.length_B.dtype == jnp.int32 and out.finished_B.dtype == jnp.bool_


@pytest.mark.slow
def test_greedy_matches_full_recompute_every_step_and_groups_share_prefill():
    out = _greedy(NEVER)
    assert out.tokens_BxT.shape == (3, T) and int(out.num_steps) == T
    assert not np.any(np.asarray(out.finished_B))
    _check_oracle(out, NEVER, 1)
    toks = np.asarray(out.tokens_BxT)
    assert len({tuple(r) for r in toks}) == 3  # the prompts really differ
    # Now call EOS a token some row first emits at a step t >= 1, and draw G=3 rows per prompt.
    r, t = next((r, t) for t in range(1, T) for r in range(3) if toks[r, t] not in toks[r, :t])
    eos = int(toks[r, t])
    g3 = _greedy(eos, group_size=3)
    assert g3.tokens_BxT.shape == (9, T)
    assert bool(g3.finished_B[3 * r]) and int(g3.length_B[3 * r]) == t + 1  # that row stops, others run on
    _check_oracle(g3, eos, 3)
    # Shared prefill + ordering: rows i*3 .. i*3+2 belong to prompt i, so greedy makes each of them
    # the G=1 row i, cut after its first EOS.
    is_eos = toks == eos
    keep = (np.cumsum(is_eos, axis=1) - is_eos) == 0
    np.testing.assert_array_equal(g3.tokens_BxT, np.repeat(np.where(keep, toks, PAD), 3, axis=0))
    np.testing.assert_allclose(g3.logp_BxT, np.repeat(np.where(keep, out.logp_BxT, 0.0), 3, axis=0), atol=1e-6)


def test_top_k_1_equals_greedy():
    prompt, pmask = _prompts()
    out = sample(
        _params(),
        CFG,
        prompt,
        pmask,
        jax.random.PRNGKey(3),
        group_size=1,
        sampling=SamplingParams(max_new_tokens=T, temperature=1.0, top_k=1, eos_id=NEVER, pad_id=PAD),
    )
    greedy = _greedy(NEVER)
    np.testing.assert_array_equal(out.tokens_BxT, greedy.tokens_BxT)
    np.testing.assert_allclose(out.logp_BxT, greedy.logp_BxT, atol=1e-6)  # logp ignores truncation


def _truncated_probs(logits_V, temperature, top_k, top_p):
    """Reference top-k then top-p distribution (numpy, independent of the sampler's code)."""
    z = np.asarray(logits_V, np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, bool)
    keep[order[: top_k or len(p)]] = True
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    before = np.cumsum(q[order]) - q[order]
    keep[order[before >= top_p]] = False
    q = np.where(keep, q, 0.0)
    return q / q.sum(), before, order


@pytest.mark.slow
def test_sampled_logp_matches_token_logprobs_and_draws_follow_top_k_top_p():
    temperature, top_k, top_p, G = 1.5, 8, 0.7, 2000
    prompt, pmask = _prompts()
    out = sample(
        _params(),
        CFG,
        prompt,
        pmask,
        jax.random.PRNGKey(7),
        group_size=G,
        sampling=SamplingParams(
            max_new_tokens=T, temperature=temperature, top_k=top_k, top_p=top_p, eos_id=NEVER, pad_id=PAD
        ),
    )
    tokens = np.asarray(out.tokens_BxT)
    assert np.all(np.asarray(out.completion_mask_BxT) == 1)
    # Recorded logp = untruncated log-softmax(logits / temperature) of the drawn token.
    prompt_g, pmask_g = jnp.repeat(prompt, G, 0), jnp.repeat(pmask, G, 0)
    logp, _ = tf.token_logprobs(_params(), CFG, prompt_g, pmask_g, out.tokens_BxT, out.completion_mask_BxT, temperature)
    np.testing.assert_allclose(np.asarray(out.logp_BxT), np.asarray(logp), atol=1e-5, rtol=0)
    # Rows of a group draw independently.
    assert all(len({tuple(r) for r in tokens[i * G : (i + 1) * G]}) > G // 2 for i in range(3))
    # First token: frequencies within each group match the reference top-k-then-top-p distribution.
    first_logits = np.asarray(tf.forward(_params(), CFG, prompt, pmask))[:, -1]
    for i in range(3):
        want, _, _ = _truncated_probs(first_logits[i], temperature, top_k, top_p)
        # Both truncations must bind, or the check could not catch one of them being ignored.
        n_k = (_truncated_probs(first_logits[i], temperature, top_k, 1.0)[0] > 0).sum()
        n_p = (_truncated_probs(first_logits[i], temperature, 0, top_p)[0] > 0).sum()
        assert 3 <= (want > 0).sum() < min(n_k, n_p), i
        got = np.bincount(tokens[i * G : (i + 1) * G, 0], minlength=CFG.vocab_size) / G
        assert np.all(got[want == 0] == 0)  # only allowed tokens are ever drawn
        np.testing.assert_allclose(got, want, atol=0.04, err_msg=f"prompt {i}")  # ~4 sigma at G=2000
    # Later steps: every drawn token lies in its step's (full-recompute) top-k / top-p set.
    rows = np.concatenate([np.arange(i * G, i * G + 20) for i in range(3)])
    logits = np.asarray(
        tf.forward(
            _params(),
            CFG,
            jnp.concatenate([prompt_g[rows], out.tokens_BxT[rows]], 1),
            jnp.concatenate([pmask_g[rows], jnp.ones((len(rows), T), jnp.int32)], 1),
        )
    )
    for j, r in enumerate(rows):
        for t in range(T):
            _, before, order = _truncated_probs(logits[j, P - 1 + t], temperature, top_k, top_p)
            rank = int(np.flatnonzero(order == tokens[r, t])[0])
            assert rank < top_k and before[rank] < top_p + 1e-4, (r, t, rank, before[rank])


@pytest.mark.slow
def test_eos_stops_rows_and_loop_exits_early():
    cfg = dataclasses.replace(CFG, vocab_size=3)  # EOS (id 2) is drawn ~1/3 of the time
    eos, pad, max_new = 2, 1, 40
    prompt, pmask = _prompts(lengths=(3, 5), vocab=3)
    out = sample(
        _params(cfg),
        cfg,
        prompt,
        pmask,
        jax.random.PRNGKey(5),
        group_size=8,
        sampling=SamplingParams(max_new_tokens=max_new, temperature=1.0, eos_id=eos, pad_id=pad),
    )
    _check_eos_layout(out, eos, pad)
    assert np.all(np.asarray(out.finished_B))
    lengths = np.asarray(out.length_B)
    assert len(set(lengths.tolist())) > 1  # rows stopped at different steps
    assert int(out.num_steps) == lengths.max() < max_new  # exited as soon as the last row finished
    logp, _ = tf.token_logprobs(
        _params(cfg),
        cfg,
        jnp.repeat(prompt, 8, 0),
        jnp.repeat(pmask, 8, 0),
        out.tokens_BxT,
        out.completion_mask_BxT,
        1.0,
    )
    mask = np.asarray(out.completion_mask_BxT) > 0
    np.testing.assert_allclose(np.asarray(out.logp_BxT)[mask], np.asarray(logp)[mask], atol=1e-5, rtol=0)


def test_temperature_zero_is_greedy_with_finite_logprobs():
    """Temperature 0 without greedy=True: the T -> 0 limit of softmax(logits / T), i.e. the greedy
    tokens, with recorded log-probs log(1) = 0 (no ties among random float logits), never NaN. Before
    the fix, logits / 0 gave NaN everywhere: token 0 at every step and NaN log-probs."""
    prompt, pmask = _prompts()
    greedy = _greedy(NEVER)
    for key in (0, 1):  # the draw no longer depends on the key
        out = sample(
            _params(),
            CFG,
            prompt,
            pmask,
            jax.random.PRNGKey(key),
            group_size=1,
            sampling=SamplingParams(max_new_tokens=T, temperature=0.0, eos_id=NEVER, pad_id=PAD),
        )
        np.testing.assert_array_equal(np.asarray(out.tokens_BxT), np.asarray(greedy.tokens_BxT))
        logp = np.asarray(out.logp_BxT)
        assert np.all(np.isfinite(logp))
        np.testing.assert_array_equal(logp, np.zeros_like(logp))


def test_temperature_zero_ties_and_negative_temperature():
    from jaxrl.rollout.sampler import scaled_logits

    # Two maximal logits: the limit distribution is 1/2 on each, so the log-prob of either is log(1/2).
    logits = jnp.asarray([[1.0, 3.0, 3.0, -2.0]])
    logp = np.asarray(jax.nn.log_softmax(scaled_logits(logits, 0.0), axis=-1))
    np.testing.assert_allclose(logp[0, 1:3], np.log(0.5), rtol=1e-6)
    assert logp[0, 0] == -np.inf and logp[0, 3] == -np.inf
    np.testing.assert_allclose(np.asarray(scaled_logits(logits, 2.0)), np.asarray(logits) / 2.0)
    prompt, pmask = _prompts()
    with pytest.raises(ValueError, match="temperature: got -0.5"):
        sample(
            _params(),
            CFG,
            prompt,
            pmask,
            jax.random.PRNGKey(0),
            group_size=1,
            sampling=SamplingParams(max_new_tokens=T, temperature=-0.5, eos_id=NEVER, pad_id=PAD),
        )


def test_sampling_params_are_hashable_with_temperature_and_eos_traced():
    """A frozen, hashable bundle; under jit its temperature and eos_id are traced (other values, the
    same program) and its other fields static (another top_k, another program)."""
    sp = SamplingParams(max_new_tokens=T, eos_id=NEVER, pad_id=PAD)
    assert {sp: 1}[SamplingParams(max_new_tokens=T, eos_id=NEVER, pad_id=PAD)] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.top_k = 3  # type: ignore[misc]
    assert jax.tree.leaves(sp) == [1.0, NEVER]
    prompt, pmask = _prompts()
    run = functools.partial(sample, _params(), CFG, prompt, pmask, jax.random.PRNGKey(0), group_size=1)
    run(sampling=sp)
    n_programs = sample.__wrapped__._cache_size()  # temperature_checked(jax.jit(sample's body))
    run(sampling=dataclasses.replace(sp, temperature=0.5, eos_id=3))
    assert sample.__wrapped__._cache_size() == n_programs
    run(sampling=dataclasses.replace(sp, top_k=4))
    assert sample.__wrapped__._cache_size() == n_programs + 1
