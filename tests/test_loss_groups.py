"""Groups of unequal size: every estimator and group-reading prepare part on a group id per row.

The batch contract's `group_id_B` (int32 [B]; equal ids = one group, rows anywhere, id < 0 or an all-0
completion mask = padding) against the equal contiguous form (`group_size`), hand-worked numbers for
GRPO / RLOO / MC-GRPO on unequal groups, padding, and the main oracle: for every preset, the batch's
advantages and prepared mask equal those of each group evaluated ALONE with group_size = its size
(batch-level presets: their batch statistic written out in NumPy over the per-group parts).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl.losses import PRESETS, evaluate_loss, multi_reward, segments
from jaxrl.losses import advantages as adv_lib
from jaxrl.losses.evaluate import check_batch, prepare_batch
from jaxrl.train import steps as steps_lib
from jaxrl.train.state import init_state

T = 5
MIXED = (3, 2, 5, 4, 3)  # group sizes for every preset but MC-GRPO
ODD = (3, 5, 3, 7)  # MC-GRPO: G+1 odd, so each group alone is a valid MC-GRPO batch
EQUAL_G = {"mc_grpo": 5, "sao": 1}  # else 4


def _sizes(name):
    return ODD if name == "mc_grpo" else MIXED


def _rows(n, rng):
    """n live rows: lengths 1..T (the full ones truncated), K = 3 binary / graded rewards, log-probs."""
    lengths = rng.integers(1, T + 1, n)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    # K = 3 so that two reward functions can outvote one (GD2PO's conflict mask then drops rows)
    rewards = np.stack([rng.integers(0, 2, n), rng.integers(0, 3, n) / 2.0, rng.integers(0, 2, n)], 1)
    rewards = rewards.astype(np.float32)
    old = -2.0 * rng.random((n, T), np.float32)
    return {
        "completion_mask_BxT": mask,
        "rewards_BxK": rewards,
        "truncated_B": (lengths == T).astype(np.float32),
        "old_logp_BxT": old,
        "rollout_logp_BxT": old + 0.5 * rng.standard_normal((n, T), np.float32),
        "old_entropy_BxT": 3.0 * rng.random((n, T)).astype(np.float32),
        # a critic's values for ppo's GAE (not drawn from rng: the other keys' draws stay as they were)
        "old_values_BxT": np.cos(np.arange(n * T, dtype=np.float32)).reshape(n, T),
        "teacher_logp_BxT": -2.0 * rng.random((n, T), np.float32),  # what the distill preset reads
    }


def _unequal_batch(sizes, seed=0, n_pad=2):
    """Groups of `sizes`, rows shuffled, group ids arbitrary (not 0..N-1), `n_pad` padding rows (mask 0)."""
    rng = np.random.default_rng(seed)
    batch = _rows(sum(sizes) + n_pad, rng)
    if sizes != ODD:  # a constant group (every reward column, and short rows: no overlong shaping): no signal
        batch["rewards_BxK"][: sizes[0]] = 1.0
        batch["completion_mask_BxT"][: sizes[0], 1:] = 0.0
        batch["truncated_B"][: sizes[0]] = 0.0
    ids = np.concatenate([np.full(n, 10 * g + 7, np.int32) for g, n in enumerate(sizes)] + [np.zeros(n_pad, np.int32)])
    ids[len(ids) - n_pad :] = ids[:n_pad]  # padding shares a real group's id: it must still count nowhere
    batch["completion_mask_BxT"][len(ids) - n_pad :] = 0.0
    batch["group_id_B"] = ids
    perm = rng.permutation(len(ids))
    return {k: v[perm] for k, v in batch.items()}


def _prepare_traced(name, batch, group_size=1):
    """(advantages_B, prepared completion_mask_BxT) of `prepare_batch`, traceable."""
    out = prepare_batch(PRESETS[name](), batch, group_size=group_size, max_new_tokens=T)
    return out["advantages_B"], out["completion_mask_BxT"]


def _in_one_program(*thunks):
    """Each thunk's result as NumPy, all computed by ONE jitted program (compiled once per test).

    A thunk is (fn, *arrays): `fn(*arrays)` is traced with the arrays as inputs. Eager dispatch would
    compile every op anew for each batch shape (the groups alone have several), and a jit per call
    pays XLA's fixed cost per call: one program for every call of a test costs about half of either.
    Only the outputs the test reads are computed (jit drops the rest: M2PO's token mask, ...)."""
    fns = [t[0] for t in thunks]
    args = [t[1:] for t in thunks]
    out = jax.jit(lambda args: [fn(*a) for fn, a in zip(fns, args)])(jax.tree.map(jnp.asarray, args))
    return jax.tree.map(np.asarray, out)


def _prep(name, batch, group_size=1):
    """A thunk for `_in_one_program`: `_prepare_traced(name, batch, group_size)`."""
    return (functools.partial(_prepare_traced, name, group_size=group_size), batch)


SEED = 2  # the unequal batch of every per-preset test (all their assertions hold on it: checked per preset)


@pytest.fixture(scope="module", params=sorted(PRESETS))
def preset(request):
    """(name, inputs and outputs of every per-preset test below), computed by ONE program per preset:
    the equal contiguous batch with and without ids; one unequal batch (`SEED`, 3 padding rows) shared
    by the permutation, padding and each-group-alone tests (its prepare computed once) and the same
    batch permuted; its live rows alone; each of its live groups alone. Pytest groups the tests by
    preset, so each preset compiles once instead of once per test (four programs, three of them with
    the shared batch's prepare again). The per-test batches were seeds 2, 4 and 5 (n_pad 2, 3, 2); seed
    2 with 3 padding rows keeps every assertion's premise (GD2PO's conflict mask drops rows on it)."""
    name = request.param
    G = EQUAL_G.get(name, 4)
    equal = _rows(3 * G if G > 1 else 8, np.random.default_rng(1))
    equal["rewards_BxK"][:G] = 1.0  # a constant group
    equal_ids = dict(equal, group_id_B=(np.arange(len(equal["truncated_B"])) // G).astype(np.int32))
    batch = _unequal_batch(_sizes(name), seed=SEED, n_pad=3)
    perm = np.random.default_rng(3).permutation(len(batch["group_id_B"]))
    live = batch["completion_mask_BxT"].any(1)
    groups = [] if name == "sao" else _live_groups(batch)  # SAO: one batch-wide baseline, no groups
    alone = [
        (functools.partial(_group_alone, name), {k: v[rows] for k, v in batch.items() if k != "group_id_B"})
        for rows in groups
    ]
    # The batch and its permutation (the same shapes) as the two lanes of one vmap: one traced prepare,
    # about a fifth less to compile.
    both = {k: np.stack([v, v[perm]]) for k, v in batch.items()}
    plain, with_ids, (adv_2xB, mask_2xBxT), live_only, *alone_out = _in_one_program(
        _prep(name, equal, G),
        _prep(name, equal_ids, G),
        (jax.vmap(functools.partial(_prepare_traced, name)), both),
        _prep(name, {k: v[live] for k, v in batch.items()}),
        *alone,
    )
    full, permuted = (adv_2xB[0], mask_2xBxT[0]), (adv_2xB[1], mask_2xBxT[1])
    return name, {
        "equal": (plain, with_ids),
        "batch": batch,
        "full": full,
        "perm": perm,
        "permuted": permuted,
        "live": live,
        "live_only": live_only,
        "alone": alone_out,
    }


# ============================================================================= the equal form


@pytest.mark.slow
def test_equal_contiguous_group_ids_give_exactly_the_group_size_path(preset):
    plain, with_ids = preset[1]["equal"]
    for a, b in zip(plain, with_ids):
        np.testing.assert_array_equal(a, b)
    assert np.any(plain[0] != 0)


@pytest.mark.slow
def test_permuting_rows_and_their_group_ids_permutes_the_advantages(preset):
    name, case = preset
    batch, perm = case["batch"], case["perm"]
    (adv, mask), (adv_p, mask_p) = case["full"], case["permuted"]
    np.testing.assert_allclose(adv_p, adv[perm], rtol=1e-5, atol=1e-5)
    if name == "mc_grpo":  # the pivot among rows tied at the median is the first in ROW order (a stable
        # sort), so a permutation may pick another tied row: compare (group, reward) of the dropped rows
        mask = mask[perm]
        batch = {k: v[perm] for k, v in batch.items()}
        live = batch["completion_mask_BxT"].any(1)
        dropped = [live & (m.sum(1) == 0) for m in (mask, mask_p)]
        key = [sorted(zip(batch["group_id_B"][d], batch["rewards_BxK"][d].sum(1))) for d in dropped]
        assert key[0] == key[1] and len(key[0]) == len(ODD)
        np.testing.assert_array_equal(mask[~(dropped[0] | dropped[1])], mask_p[~(dropped[0] | dropped[1])])
        return
    np.testing.assert_array_equal(mask_p, mask[perm])
    assert np.any(adv != 0)


# ============================================================================= hand-worked


def test_grpo_on_groups_of_3_and_5_by_hand():
    # group 7 (3 rows) r = [1, 0, 0]: mean 1/3, centred [2/3, -1/3, -1/3], sum sq = 4/9 + 1/9 + 1/9 = 2/3,
    #   unbiased std = sqrt((2/3) / 2) = 0.577350 -> A = [1.154701, -0.577350, -0.577350]
    # group 3 (5 rows) r = [1, 1, 0, 0, 0]: mean 0.4, centred [.6, .6, -.4, -.4, -.4], sum sq = .72 + .48
    #   = 1.2, unbiased std = sqrt(1.2 / 4) = 0.547723 -> A = [1.095445, 1.095445, -0.730297 x3]
    # (ddof=0: std_7 = sqrt(2/9) = 0.471405 -> 1.414214 / -0.707107; std_3 = sqrt(.24) = .489898 -> 1.224745 / -.816497)
    ids = np.array([3, 7, 3, 7, 3, 3, 7, 3], np.int32)
    r = np.array([1, 1, 1, 0, 0, 0, 0, 0], np.float32)

    def by_ddof(r_B, id_B):  # [ddof 1, ddof 0]
        g = segments.from_ids(id_B)
        return [adv_lib.group_mean_std(ddof=ddof)(r_B, g) for ddof in (1, 0)]

    # a group of one (id 9) appended: it has no spread
    (unbiased, population), with_9 = _in_one_program(
        (by_ddof, r, ids), (by_ddof, np.append(r, 1.0), np.append(ids, 9).astype(np.int32))
    )
    want = [1.095445, 1.154701, 1.095445, -0.577350, -0.730297, -0.730297, -0.577350, -0.730297]
    np.testing.assert_allclose(unbiased, want, rtol=1e-5)
    want0 = [1.224745, 1.414214, 1.224745, -0.707107, -0.816497, -0.816497, -0.707107, -0.816497]
    np.testing.assert_allclose(population, want0, rtol=1e-5)
    # the group of one gets exactly 0, whatever ddof; the others do not move
    for out in with_9:
        assert out[-1] == 0.0 and np.isfinite(out).all()
    np.testing.assert_allclose(with_9[0][:-1], want, rtol=1e-5)


def test_rloo_leaves_one_out_of_each_groups_own_size():
    # [1, 0, 0] (n=3): baselines (0+0)/2, (1+0)/2, (1+0)/2 -> A = [1, -.5, -.5]
    # [1, 0] (n=2): A = [1, -1];  [1] (n=1): no baseline -> 0
    # [.5, 1, 0, .5] (n=4, sum 2): baselines 1.5/3, 1/3, 2/3, 1.5/3 -> A = [0, 2/3, -2/3, 0]
    r = np.array([1, 0, 0, 1, 0, 1, 0.5, 1, 0, 0.5], np.float32)
    ids = np.array([0, 0, 0, 1, 1, 2, 3, 3, 3, 3], np.int32)
    perm = np.array([9, 2, 5, 0, 7, 3, 1, 8, 4, 6])
    want = np.array([1, -0.5, -0.5, 1, -1, 0, 0, 2 / 3, -2 / 3, 0], np.float32)
    [out] = _in_one_program((lambda r_B, id_B: adv_lib.rloo(r_B, segments.from_ids(id_B)), r[perm], ids[perm]))
    np.testing.assert_allclose(out, want[perm], rtol=1e-6, atol=1e-7)


def test_mc_grpo_median_mad_and_rescale_with_each_groups_own_size():
    # Paper-code default: A = (r - M) / (MAD + 1e-3), then x n / #nonzero on the non-zero rows, n the group's size.
    # n=3 [1, 0, 0]: M = 0 (pivot: 2nd of the stable sort [row1, row2, row0] = row 2), A = [1, 0, 0];
    #   MAD = median [1, 0, 0] = 0 -> A = [1000, 0, 0]; 1 nonzero -> x 3/1 -> [3000, 0, 0]
    # n=5 [1, 1, 1, 0, 0]: sorted rows [3, 4, 0, 1, 2], M = 1 (pivot row 0), A = [0, 0, 0, -1, -1];
    #   MAD = 0 -> -1000; 2 nonzero -> x 5/2 -> [0, 0, 0, -2500, -2500]
    # n=4 (even, LOWER median) [0, 1, 1, .5]: sorted [0, .5, 1, 1], position (4-1)//2 = 1: M = .5 (pivot row 3),
    #   A = [-.5, .5, .5, 0]; |A| sorted [0, .5, .5, .5] -> MAD = .5 -> A / .501 = [-.998004, .998004, .998004, 0];
    #   3 nonzero -> x 4/3 -> [-1.330672, 1.330672, 1.330672, 0]
    r = np.array([1, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0.5], np.float32)
    ids = np.array([0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2], np.int32)
    want = np.array([3000, 0, 0, 0, 0, 0, -2500, -2500, -1.330672, 1.330672, 1.330672, 0], np.float32)
    perm = np.random.default_rng(0).permutation(12)
    # Ties go by row order of the (permuted) batch: group 0's pivot is the LATER of rows 1, 2 (2nd tied row at
    # M = 0), group 1's the EARLIEST of rows 3, 4, 5 (sorted position 2 = 1st row tied at M = 1), group 2's row 11.
    at = np.argsort(perm)  # at[i] = where original row i sits in the permuted batch
    pivot = np.zeros(12, np.float32)
    pivot[[max((1, 2), key=lambda i: at[i]), min((3, 4, 5), key=lambda i: at[i]), 11]] = 1.0
    batch = {
        "completion_mask_BxT": np.ones((12, T), np.float32),
        "rewards_BxK": r[perm][:, None],
        "group_id_B": ids[perm],
    }

    def median_and_pivot(r_B, id_B):
        g = segments.from_ids(id_B)
        return adv_lib.group_median()(r_B, g), adv_lib.median_pivot(r_B, g)

    (median, pivot_out), (adv, mask) = _in_one_program((median_and_pivot, r[perm], ids[perm]), _prep("mc_grpo", batch))
    np.testing.assert_allclose(median, want[perm], rtol=1e-5)
    np.testing.assert_array_equal(pivot_out, pivot[perm])
    # the preset drops exactly those pivot rows from the loss
    np.testing.assert_allclose(adv, want[perm], rtol=1e-5)
    np.testing.assert_array_equal(mask[:, 0], 1.0 - pivot[perm])


# ============================================================================= padding


@pytest.mark.slow
def test_padding_rows_get_zero_and_do_not_move_the_others(preset):
    case = preset[1]
    live = case["live"]
    (adv, mask), (adv_live, mask_live) = case["full"], case["live_only"]
    assert np.all(adv[~live] == 0) and np.all(mask[~live] == 0)
    np.testing.assert_allclose(adv[live], adv_live, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(mask[live], mask_live)
    assert np.any(adv != 0)  # groups were read (group_size=1 alone would give all-0 group advantages)


def test_a_negative_group_id_is_padding_whatever_its_rewards():
    r = np.array([1.0, 0.0, 5.0, 1.0, 0.0], np.float32)
    norms = (adv_lib.group_mean_std(), adv_lib.group_mean_batch_whiten(), adv_lib.batch_mean, adv_lib.rloo)
    [outs] = _in_one_program(
        (
            lambda r_B, id_B: [norm(r_B, segments.from_ids(id_B)) for norm in norms],
            r,
            np.array([0, 0, -1, 1, 1], np.int32),
        )
    )
    for out in outs:
        assert out[2] == 0.0
        np.testing.assert_allclose(out[[0, 1]], out[[3, 4]], rtol=1e-6)  # the two live groups alike


def test_an_explicit_live_mask_keeps_a_padding_row_out_of_the_group_it_shares_an_id_with():
    r = np.array([1.0, 0.0, 0.0, 9.0], np.float32)

    def padded(r_B):  # one id, row 3 padding
        return adv_lib.group_mean_std()(
            r_B, segments.from_ids(jnp.asarray([4, 4, 4, 4]), live_B=jnp.asarray([1, 1, 1, 0]))
        )

    alone, with_pad = _in_one_program((lambda r_B: adv_lib.group_mean_std()(r_B, 3), r[:3]), (padded, r))
    np.testing.assert_allclose(with_pad[:3], alone, rtol=1e-6)
    assert float(with_pad[3]) == 0.0


def test_dapo_drops_whole_constant_groups_and_keeps_zero_rows_of_informative_ones():
    # ids 2: r [1, 0, .5] -> A = [1, -1, 0]: informative, its A = 0 row stays; ids 5: r [1, 1] constant -> dropped;
    # ids 8: r [0, 1, 1, 0] informative. Short rows: no overlong shaping (L_max = 5, L_c = 1, |y| = 2).
    ids = np.array([2, 5, 8, 2, 8, 5, 2, 8, 8], np.int32)
    r = np.array([1, 1, 0, 0, 1, 1, 0.5, 1, 0], np.float32)
    batch = {
        "completion_mask_BxT": (np.arange(T)[None, :] < 2).repeat(9, 0).astype(np.float32),
        "rewards_BxK": r[:, None],
        "group_id_B": ids,
    }
    [(adv, mask)] = _in_one_program(_prep("dapo", batch))
    assert adv[6] == 0.0
    np.testing.assert_array_equal(mask[:, 0], (ids != 5).astype(np.float32))


# ============================================================================= the oracle: each group alone


def _whiten(a, eps=1e-6):
    """NumPy batch whitening over the live rows (unbiased std); all-zero groups handled by the caller."""
    return (a - a.mean()) / (a.std(ddof=1) + eps)


def _group_alone(name, sub):
    """(adv, mask) of one group's rows, evaluated alone with group_size = its size (traceable)."""
    n = sub["completion_mask_BxT"].shape[0]
    if name == "reinforce_pp":  # group stage alone; the batch stage is the caller's
        return adv_lib.group_mean(sub["rewards_BxK"].sum(1), n), sub["completion_mask_BxT"]
    if name in ("gdpo", "gd2po"):
        z = multi_reward.group_z_scores(sub["rewards_BxK"], n)
        parts = multi_reward.gd2po_parts(sub["rewards_BxK"], n)
        keep = parts["keep_B"] if name == "gd2po" else jnp.ones(n, jnp.float32)
        return (z.sum(1), parts["consensus_B"], keep), sub["completion_mask_BxT"] * keep[:, None]
    return _prepare_traced(name, sub, n)


def _live_groups(batch):
    """The row indices of each live group, in group-id order."""
    live = batch["completion_mask_BxT"].any(1)
    return [np.flatnonzero(live & (batch["group_id_B"] == gid)) for gid in np.unique(batch["group_id_B"][live])]


def _oracle(name, batch, alone):
    """The advantages and prepared mask the batch must get, from `alone[i]` = `_group_alone` of the
    rows `_live_groups(batch)[i]` (batch-level presets: their batch statistic written out here)."""
    live = batch["completion_mask_BxT"].any(1)
    B = len(live)
    adv, mask = np.zeros(B, np.float32), np.zeros_like(batch["completion_mask_BxT"])
    if name == "sao":  # one rollout per prompt: the baseline is the mean over the batch's live rows
        r = batch["rewards_BxK"].sum(1)
        adv[live] = r[live] - r[live].mean()
        return adv, batch["completion_mask_BxT"]
    per_group = []
    for rows, (a, group_mask) in zip(_live_groups(batch), alone, strict=True):
        mask[rows] = group_mask
        per_group.append((rows, a))
    if name not in ("reinforce_pp", "gdpo", "gd2po"):
        for rows, a in per_group:
            adv[rows] = a
        return adv, mask
    rows_all = np.concatenate([rows for rows, _ in per_group])
    a_all = np.concatenate([a if name == "reinforce_pp" else a[0] for _, a in per_group])
    white = dict(zip(rows_all, _whiten(a_all)))
    for rows, a in per_group:
        a0 = a if name == "reinforce_pp" else a[0]
        if np.any(a0 != 0):
            adv[rows] = [white[i] for i in rows]
        if name == "gd2po":
            adv[rows] *= a[1] * a[2]  # consensus ** 1 * keep
    return adv, mask


@pytest.mark.slow
def test_every_preset_on_unequal_groups_equals_each_group_alone(preset):
    name, case = preset
    batch, (adv, mask) = case["batch"], case["full"]
    want_adv, want_mask = _oracle(name, batch, case["alone"])
    np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(mask, want_mask)
    assert np.any(adv != 0)
    if name in ("gd2po", "mc_grpo", "dapo"):  # the row filter does drop live rows here
        assert np.any(batch["completion_mask_BxT"].any(1) & ~mask.any(1))


# ============================================================================= the batch contract


def test_check_batch_validates_group_id_B():
    batch = {"completion_mask_BxT": np.ones((5, T), np.float32)}
    check_batch(dict(batch, group_id_B=np.arange(5, dtype=np.int32)), 2, T)  # 5 rows, no groups of 2: fine with ids
    with pytest.raises(ValueError, match="group_size=2 does not divide"):
        check_batch(batch, 2, T)
    for bad, what in (
        (np.arange(4, dtype=np.int32), "shape"),
        (np.zeros((5, 1), np.int32), "shape"),
        (np.arange(5, dtype=np.float32), "dtype"),
        (np.arange(5, dtype=np.uint32), "dtype"),
    ):
        with pytest.raises(ValueError, match=rf"group_id_B.*{what}"):
            check_batch(dict(batch, group_id_B=bad), 2, T)


@pytest.mark.slow
def test_update_step_reads_group_id_B_across_microbatches():
    # 6 rows in 2 microbatches of 3; groups {0, 3, 4} and {1, 2, 5} cross both, unlike row // 2.
    V = 4
    rng = np.random.default_rng(0)

    def logp_fn(params, batch):
        logp_V = jax.nn.log_softmax(params["w"])
        logp_BxT = logp_V[batch["tokens_BxT"]]
        return logp_BxT, jnp.zeros_like(logp_BxT)

    params = {"w": jnp.linspace(-1.0, 1.0, V)}
    batch = {
        "tokens_BxT": rng.integers(0, V, (6, T)).astype(np.int32),
        "completion_mask_BxT": np.ones((6, T), np.float32),
        "rewards_BxK": np.array([[1], [0], [1], [0], [0], [0]], np.float32),
        "group_id_B": np.array([0, 1, 1, 0, 0, 1], np.int32),
    }
    loss = PRESETS["grpo"]()
    step = steps_lib.make_update_step(
        logp_fn, loss, optax.sgd(0.1), ppo_epochs=1, microbatches=2, max_new_tokens=T, group_size=2
    )
    state, _ = jax.jit(step)(init_state(params, optax.sgd(0.1), jax.random.key(0)), batch)
    applied = (params["w"] - state.params["w"]) / 0.1  # SGD: the update applied -0.1 * its gradient

    def grad(b):
        def value(p):
            return evaluate_loss(loss, logp_fn(p, b)[0], b, group_size=2, max_new_tokens=T).loss

        return jax.grad(value)(params)["w"]

    want, without_ids = _in_one_program((grad, batch), (grad, {k: v for k, v in batch.items() if k != "group_id_B"}))
    np.testing.assert_allclose(applied, want, rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(want - without_ids))) > 1e-3  # the ids matter on this batch
