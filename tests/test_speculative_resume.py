"""Speculative rollouts keep the run's guarantees: a resumed run matches an uninterrupted one, and two
fresh runs of one config match each other, although the step costs that steer speculation are timed
on the machine. The timing is replaced by a fake that answers differently on every call (cheap
speculation, then expensive), as a loaded machine might; before the costs were cached per machine
and checkpointed (and the reuse draft store checkpointed), each run re-timed and drafted afresh."""

import shutil

import numpy as np
import pytest
from preset_configs import config_path, overrides

from jaxrl.config import load_config
from jaxrl.rollout.speculative import calibrate

pytestmark = pytest.mark.usefixtures("persistent_compile_cache")  # training runs repeat programs


def _steps(drafter):
    """Reuse drafts from step 3 on (a prompt's previous completions), so its run resumes into step 3;
    the self-drafters speculate from step 1, so theirs resume into step 2. The resumed run's first step
    is the one that needs the costs and the draft store from the checkpoint."""
    return 3 if drafter == "reuse" else 2


TIMING = ("rollout/tokens_per_s", "rollout/seconds", "step_seconds", "wall_time")
SPEC = [
    "rollout.speculative.enabled=true",
    "rollout.speculative.reuse_width=4",
    "rollout.speculative.max_draft=2",
    "rollout.speculative.draft_layers=1",
    "rollout.speculative.probe_every=1",
    "rollout.speculative.calibrate=true",
]


def _config(drafter):
    # 8 prompts, 4 a step: every prompt comes back after 2 steps, so reuse has drafts to verify.
    extra = [
        f"train.steps={_steps(drafter)}",
        "checkpoint.every=1",
        "checkpoint.keep=10",
        "data.num_train=8",
        f"rollout.speculative.drafter={drafter}",
    ]
    if drafter == "early_exit":  # its drafter is the first of 2 layers; the others run the preset's 1-layer
        extra.append("model.n_layers=2")  # model, whose update and warm start the suite has compiled already
    return load_config(config_path("grpo"), overrides("grpo") + SPEC + extra)


@pytest.fixture()
def flaky_timer(monkeypatch, tmp_path):
    """measure_step_costs answers cheap, then expensive, then cheap...; the cost cache lives in tmp_path."""
    import jaxrl.train.loop as loop

    calls = []

    def fake(params, cfg, spec, n_rows, cache_len, **kw):
        K = calibrate.widest_draft(spec)
        calls.append(n_rows)
        if len(calls) % 2:  # speculation pays: a verify costs about one step
            return calibrate.StepCosts(np.full((K,), 1.05, np.float32), np.float32(0.05))
        return calibrate.StepCosts(1.0 + 3.0 * np.arange(1, K + 1, dtype=np.float32), np.float32(1.0))

    monkeypatch.setattr(calibrate, "measure_step_costs", fake)
    monkeypatch.setattr(loop, "cache_root", lambda cfg: tmp_path / "cache")
    return calls


def _same(rows_a, rows_b, steps):
    def by_step(rows):
        return {r["step"]: r for r in rows}

    a, b = by_step(rows_a), by_step(rows_b)
    for s in steps:
        keys = (set(a[s]) | set(b[s])) - set(TIMING)
        diff = {k: (a[s].get(k), b[s].get(k)) for k in keys if a[s].get(k) != b[s].get(k)}
        assert not diff, (s, diff)


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["reuse", "early_exit", "int8"])
def test_speculative_reruns_and_resumes_match(
    drafter,
    tmp_path,
    in_process_cache,
    flaky_timer,
    capsys,
):
    from jaxrl.train.loop import train

    cfg, steps = _config(drafter), _steps(drafter)
    first = train(cfg, tmp_path / "first")
    assert [r["step"] for r in first] == list(range(steps + 1))
    assert len(flaky_timer) == 1
    # Reuse drafts from step 3 on (each prompt's previous completions); the self-drafters from step 1.
    assert all(r["spec/speculated_frac"] > 0 for r in first[3 if drafter == "reuse" else 1 :]), "never speculated"
    assert "measured now" in capsys.readouterr().err

    # A second fresh run on this machine reads the cached costs instead of timing again.
    second = train(cfg, tmp_path / "second")
    assert len(flaky_timer) == 1 and "cached in" in capsys.readouterr().err
    _same(first, second, range(steps + 1))

    # A kill after the last step's checkpoint began: it never finished. The resumed run takes the
    # costs and the draft store from the previous checkpoint and ends exactly like the uninterrupted run.
    shutil.rmtree(tmp_path / "cache")
    killed = tmp_path / "killed"
    shutil.copytree(tmp_path / "first", killed)
    shutil.rmtree(killed / "checkpoints" / str(steps))
    resumed = train(cfg, killed)
    assert len(flaky_timer) == 1 and "from the checkpoint" in capsys.readouterr().err
    assert [r["step"] for r in resumed] == list(range(steps + 1))
    _same(first, resumed, range(steps + 1))


def test_draft_store_round_trip():
    from jaxrl.rollout.speculative.reuse import DraftStore

    store = DraftStore(max_prompts=3)
    rng = np.random.default_rng(0)
    G, T = 2, 5
    for step in range(4):  # 4 prompts of different lengths into a store of 3: the first is evicted
        prompt = rng.integers(1, 30, (1, 6)).astype(np.int32)
        mask = np.arange(6)[None] >= step
        store.update(prompt, mask, rng.integers(1, 30, (G, T)), np.asarray([3, 5]), rng.normal(size=(G, T)), G)
    back = DraftStore.from_state(store.to_state())
    assert back.max_prompts == 3 and list(back._table) == list(store._table)
    for key, (tok, n, lp) in store._table.items():
        np.testing.assert_array_equal(back._table[key][0], tok)
        np.testing.assert_array_equal(back._table[key][1], n)
        np.testing.assert_array_equal(back._table[key][2], lp)
    empty = DraftStore.from_state(DraftStore(7).to_state())
    assert len(empty) == 0 and empty.max_prompts == 7
