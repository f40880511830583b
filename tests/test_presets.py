"""The contract every loss preset keeps, in one test parametrised over the registry (plus the options
every preset takes), and the `jaxrl variants` table.

Hand-worked numbers for each composition, the new parts and the update-step wiring of `prepare` are
in test_preset_numbers.py; each config file trains in test_preset_configs.py.

Cost control (2 busy CPU cores): the contract compiles ONE program per preset that computes every
variant (full batch and permuted groups as the two lanes of one vmap; padded columns in microbatches
of 2 rows; the suite's cheap-compile policy, tests/harness.py) and runs only the full batch eagerly for
"jit == no jit" (eager kernels are shared by presets).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import cli
from jaxrl.losses import aggregation, batch_advantages
from jaxrl.losses.presets import PRESETS
from jaxrl.train import steps as steps_lib


def _close(a, b, atol=1e-6, rtol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=rtol)


# ============================================================================= the contract

T, L_MAX, PAD = 6, 8, 3
MB_ROWS = 2  # microbatches of 2 rows: every group of G >= 3 is split across microbatches
GROUP = {"mc_grpo": 5, "sao": 1}  # odd G+1 for MC-GRPO, single rollout for SAO; 4 otherwise
# One batch shape for every preset (5 groups of 4, 4 of MC-GRPO's 5, 20 SAO rollouts): the eager
# "jit == no jit" run compiles its op-by-op kernels per shape, so the presets share them.
B = 20
# Options every preset accepts, exercised on top of a preset (TIS/MIS, entropy, top-entropy, truncation,
# KL in the reward).
EXTRA_CASES = {
    "grpo+is_seq": ("grpo", dict(tis_cap=1.5, mis_low=0.5, mis_high=2.0, is_level="sequence")),
    "bnpo+extras": (
        "bnpo",
        dict(
            tis_cap=1.2,
            mis_low=0.7,
            mis_high=1.4,
            entropy_coef=0.01,
            top_entropy_frac=0.5,
            mask_truncated=True,
            kl_reward_beta=0.1,
            kl_reward_estimator="k3",
        ),
    ),
}
CASES = sorted(PRESETS) + sorted(EXTRA_CASES)
# Metrics that must be > 0 on the contract batch (the batch does exercise what the preset reports).
CLIPS = ("clipped_low", "clipped_high")
EXPECT = {
    "cispo": ("clipped_high",),
    "sapo": ("gate",),
    "m2po": ("m2po_masked",),
    "mu_grpo": CLIPS + ("vetoed",),
    "grpo+is_seq": CLIPS + ("is_weight", "is_truncated", "mis_masked"),
    "bnpo+extras": CLIPS + ("is_weight", "mis_masked", "entropy_masked"),
}


def _case(name):
    preset, extras = EXTRA_CASES.get(name, (name, {}))
    return preset, PRESETS[preset](kl_beta=0.05, **extras)


def _inputs(G, B):
    rng = np.random.default_rng(42)
    lengths = rng.integers(0, T + 1, B)
    lengths[0], lengths[1] = T, 0  # a full (truncated) row and an empty row
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    rewards = rng.integers(0, 2, (B, 2)).astype(np.float32)
    if G > 1:
        rewards[:G] = 1.0  # one constant group
    logp = -2.0 * rng.random((B, T), np.float32)
    old = logp + 0.6 * rng.standard_normal((B, T), np.float32)  # wide enough that some tokens clip
    ref = logp + 0.3 * rng.standard_normal((B, T), np.float32)
    rollout = old + 0.3 * rng.standard_normal((B, T), np.float32)  # sampler != trainer: TIS / MIS / M2PO act
    garbage = np.where(rng.random((B, T)) < 0.5, 1e4, -1e4).astype(np.float32)
    dead = mask == 0
    batch = {
        "completion_mask_BxT": mask,
        "old_logp_BxT": np.where(dead, garbage, old),
        "ref_logp_BxT": np.where(dead, -garbage, ref),
        "rollout_logp_BxT": np.where(dead, garbage, rollout),
        "teacher_logp_BxT": np.where(dead, -garbage, ref - 0.2),  # the distill preset's teacher
        "entropy_BxT": np.ones((B, T), np.float32),
        "old_entropy_BxT": np.where(dead, garbage, 3.0 * rng.random((B, T))).astype(np.float32),
        "truncated_B": (lengths == T).astype(np.float32),
        "rewards_BxK": rewards,
        "old_values_BxT": np.where(dead, garbage, rng.random((B, T))).astype(np.float32),  # a critic's (ppo)
    }
    return logp, batch


def _prepare(loss, G, logp, batch, max_new_tokens=L_MAX):
    """As steps.py does, on the WHOLE batch: prepare, then the aggregation weights."""
    batch = loss.prepare(dict(batch), G, max_new_tokens)
    return dict(batch, weights_BxT=loss.weights(batch["completion_mask_BxT"], max_new_tokens), logp_BxT=logp)


def _run(loss, G, logp, batch, microbatches=1, max_new_tokens=L_MAX, grad=True):
    """`_prepare`, then a `lax.scan` over microbatches summing weighted_sum(weights, token_loss), as
    steps.py does. Returns (value, grad (None if not `grad`), metrics, prepared mask)."""
    batch = _prepare(loss, G, logp, batch, max_new_tokens)
    mask = batch["completion_mask_BxT"]

    def one(mb):
        def f(lp):
            loss_BxT, stats = loss.token_loss(lp, mb)
            return (
                aggregation.weighted_sum(mb["weights_BxT"], loss_BxT),
                aggregation.stat_partials(stats, mb["completion_mask_BxT"]),
            )

        if not grad:
            v, part = f(mb["logp_BxT"])
            return v, None, part
        (v, part), g = jax.value_and_grad(f, has_aux=True)(mb["logp_BxT"])
        return v, g, part

    if microbatches == 1:
        value, grad, partials = one(batch)
    else:  # one traced body for every microbatch, as in steps.make_grad_fn
        mbs = steps_lib.split_microbatches(batch, microbatches)
        part_shape = jax.eval_shape(one, jax.tree.map(lambda x: x[0], mbs))[2]
        init = jax.tree_util.tree_map_with_path(
            lambda path, x: jnp.full(x.shape, {"min": jnp.inf, "max": -jnp.inf}.get(path[-1].key, 0.0), x.dtype),
            part_shape,
        )

        def body(carry, mb):
            v, g, part = one(mb)
            return (carry[0] + v, aggregation.merge_stat_partials(carry[1], part)), g

        (value, partials), grads = jax.lax.scan(body, (jnp.zeros((), jnp.float32), init), mbs)
        grad = steps_lib.merge_microbatches(grads)
    return value, grad, aggregation.finalize_stats(partials), mask


def _pad(key, x, value):
    return jnp.pad(x, ((0, 0), (0, PAD)), constant_values=value) if key.endswith("_BxT") else x


def _variants(loss, G, logp, batch, perm_rows):
    """Every variant the contract compares, in one program: the full batch and the group-permuted one
    (advantages recomputed from the permuted rewards, as the pipeline would) as the two lanes of one
    `vmap` (the same shapes: one traced prepare + loss + gradient for both; the program compiles about
    a fifth faster); and, not batched, the batch with padding columns (garbage log-probs, mask 0) split
    into microbatches of MB_ROWS rows (two invariances in one variant, one compile fewer)."""
    permuted = {k: v[perm_rows] for k, v in batch.items()}
    both = jax.tree.map(lambda a, b: jnp.stack([a, b]), batch, permuted)
    # with the reward shaping, as the update step
    adv, adv_perm = jax.vmap(lambda b: batch_advantages(loss, b, G, L_MAX))(both)
    full_batch = dict(batch, advantages_B=adv)
    both["advantages_B"] = jnp.stack([adv, adv_perm])
    full, perm = _unstack(jax.vmap(functools.partial(_run, loss, G))(jnp.stack([logp, logp[perm_rows]]), both))
    out = {"adv": adv, "adv_perm": adv_perm, "full": full, "perm": perm}
    padded = {k: _pad(k, v, 1e4) for k, v in full_batch.items()}
    padded["completion_mask_BxT"] = _pad("_BxT", batch["completion_mask_BxT"], 0.0)
    out["pad_mb"] = _run(loss, G, _pad("_BxT", logp, -5.0), padded, logp.shape[0] // MB_ROWS)
    return out


def _unstack(tree):
    """The two lanes of a vmapped result."""
    return jax.tree.map(lambda x: x[0], tree), jax.tree.map(lambda x: x[1], tree)


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_contract(name):
    preset, loss = _case(name)
    G = GROUP.get(preset, 4)
    logp, batch = _inputs(G, B)
    n_groups = B // G
    order = np.random.default_rng(7).permutation(n_groups)
    perm_rows = np.concatenate([g * G + np.arange(G) for g in order])
    fn = jax.jit(functools.partial(_variants, loss, G))
    out = fn.lower(logp, batch, perm_rows).compile()(logp, batch, perm_rows)

    value, grad, metrics, prepared_mask = out["full"]
    grad, prepared_mask = np.asarray(grad), np.asarray(prepared_mask)
    assert np.isfinite(float(value)) and np.all(np.isfinite(grad))
    assert np.max(np.abs(grad)) > 0
    # no gradient on masked tokens, nor on rows / tokens prepare removed (pivot, conflicts, ...)
    np.testing.assert_array_equal(grad[prepared_mask == 0], 0.0)
    assert all(np.isfinite(float(v)) for v in metrics.values())
    assert float(metrics["kl"]) > 0 and float(metrics["ratio_max"]) > float(metrics["ratio_min"])
    for key in EXPECT.get(name, EXPECT.get(preset, CLIPS)):
        assert float(metrics[key]) > 0, key

    def same(variant, rows=slice(None), rtol=1e-5):
        v, g, m, _ = out[variant]
        _close(v, value, atol=1e-6, rtol=rtol)
        _close(np.asarray(g)[:, :T], grad[rows], atol=1e-7, rtol=rtol)
        assert m.keys() == metrics.keys()
        for key in m:
            _close(m[key], metrics[key], atol=1e-6, rtol=1e-5)

    # Padding columns (garbage log-probs) change nothing and get no gradient; microbatches (groups split
    # across them) through prepare + whole-batch weights give the full-batch loss, gradient and metrics.
    same("pad_mb")
    np.testing.assert_array_equal(np.asarray(out["pad_mb"][1])[:, T:], 0.0)
    _close(out["adv_perm"], np.asarray(out["adv"])[perm_rows], atol=1e-6)
    same("perm", rows=perm_rows)  # the order of groups does not matter

    # jit == no jit: the whole path (prepare, weights, token loss, stats) run eagerly, op by op. The
    # gradient is compared under jit only: eager autodiff op by op costs seconds per preset here.
    e_value, _, e_metrics, e_mask = _run(loss, G, jnp.asarray(logp), dict(batch, advantages_B=out["adv"]), grad=False)
    _close(e_value, value, rtol=1e-5)
    np.testing.assert_array_equal(e_mask, prepared_mask)
    for key in metrics:
        _close(e_metrics[key], metrics[key], rtol=1e-5)


def test_variants_command_lists_every_preset(capsys):
    assert cli.main(["variants"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "| preset | paper | parts | rollout.group_size | config |"
    for name, preset in PRESETS.items():
        row = next(line for line in lines if line.startswith(f"| {name} |"))
        assert preset.paper in row and f"configs/{name}_arithmetic.py" in row
        assert " ; ".join(preset.parts) in row
    assert "arXiv:2503.14476" in out and "tis_cap" in out
