"""A run keeps a reference policy only when its loss has a KL term: without one the state, every
checkpoint and the update hold no reference; with one (loss.kl_beta > 0) the run keeps it, logs `kl`
and resumes exactly; a checkpoint written before the reference was optional (it always held a
copy) resumes exactly in a run without one.

Four 1-3 step in-process runs of the TINY default config (test_resume.py kills a default run with
SIGKILL; here a resume is a rerun after deleting the newest checkpoint, same guarantee, no subprocess).
"""

import math
import pathlib
import shutil

import orbax.checkpoint as ocp
import pytest
from conftest import DEFAULT_CONFIG, TINY

from jaxrl.config import ConfigError, load_config
from jaxrl.train import checkpoint as ckpt
from jaxrl.train import loop

pytestmark = pytest.mark.usefixtures("persistent_compile_cache")  # training runs repeat programs

STEPS = 3  # checkpoints at 2 and 3 (the last step always saves): a resume from 2 replays one real update
# The format reward too (the tiny policy gets no sum right): groups differ, the policy moves.
OVERRIDES = [t for t in TINY if not t.startswith("train.eval_")] + [
    f"train.steps={STEPS}",
    "checkpoint.every=2",
    "train.eval_every=0",
    "train.eval_prompts=4",
    "loss.reward_weights=1,1",
    "optim.learning_rate=1e-2",
    "optim.warmup_steps=0",
]
DETERMINISTIC = ("reward/mean", "loss", "grad_norm", "entropy", "clip_frac", "response_len/mean", "kl")


def _config(*extra):
    return load_config(DEFAULT_CONFIG, OVERRIDES + list(extra))


def _holds_ref(workdir: pathlib.Path, step: int) -> bool:
    return (
        ocp.StandardCheckpointHandler().metadata(workdir / "checkpoints" / str(step) / "state").get("ref_params")
        is not None
    )


def _size(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _resume_from_step_2(workdir: pathlib.Path, copy: pathlib.Path, cfg) -> list[dict]:
    """Rerun a copy of a finished run whose last (step-STEPS) checkpoint is gone: it resumes at step 2."""
    shutil.copytree(workdir, copy)
    shutil.rmtree(copy / "checkpoints" / str(STEPS))
    return loop.train(cfg, copy)


def _assert_same_steps(resumed: list[dict], straight: list[dict]) -> None:
    by_step = {r["step"]: r for r in resumed}
    assert sorted(by_step) == list(range(STEPS + 1))
    assert all(row["grad_norm"] > 0 for row in straight[3:])  # real updates after the resume point
    for row in straight[3:]:
        for key in DETERMINISTIC:
            assert by_step[row["step"]].get(key) == row.get(key), (row["step"], key)


@pytest.mark.slow
def test_old_checkpoint_with_a_reference_copy_resumes_exactly_without_one(tmp_path, in_process_cache, monkeypatch):
    cfg = _config()
    assert cfg.loss.kl_beta == 0
    # The code before this change: every state (and checkpoint) held a reference copy, unused by the loss.
    real = loop._initial_state
    monkeypatch.setattr(loop, "_initial_state", lambda *a, **kw: real(*a, **dict(kw, with_ref=True)))
    old = loop.train(cfg, tmp_path / "old")
    assert _holds_ref(tmp_path / "old", 2) and "kl" not in old[1]
    monkeypatch.setattr(loop, "_initial_state", real)

    resumed = _resume_from_step_2(tmp_path / "old", tmp_path / "new", cfg)
    _assert_same_steps(resumed, old)
    assert not _holds_ref(tmp_path / "new", STEPS)  # what the new code saves: no reference
    assert all("kl" not in row for row in resumed)
    # a reference copy is a params-sized part of the checkpoint (params, 2 Adam moments, reference)
    with_ref, without = (
        _size(tmp_path / "old" / "checkpoints" / str(STEPS)),
        _size(tmp_path / "new" / "checkpoints" / str(STEPS)),
    )
    assert 0.6 < without / with_ref < 0.85, (without, with_ref)


@pytest.mark.slow
def test_kl_run_keeps_its_reference_logs_kl_and_resumes_exactly(tmp_path, in_process_cache):
    cfg = _config("loss.kl_beta=0.05")
    straight = loop.train(cfg, tmp_path / "kl")
    assert _holds_ref(tmp_path / "kl", 2) and _holds_ref(tmp_path / "kl", STEPS)
    assert all(math.isfinite(row["kl"]) for row in straight[1:])
    assert straight[-1]["kl"] > 0  # the policy has moved away from the reference
    _assert_same_steps(_resume_from_step_2(tmp_path / "kl", tmp_path / "kl_resumed", cfg), straight)


def test_a_checkpoint_without_reference_is_refused_for_a_kl_loss(tmp_path):
    # What `match_reference` checks before a restore: the newest checkpoint lacks the reference a KL
    # loss needs (the run was trained without one) -> one ConfigError line, nothing touched.
    import jax.numpy as jnp

    from jaxrl.config import CheckpointConfig
    from jaxrl.train.state import TrainState

    params = {"w": jnp.ones(3)}
    manager = ckpt.make_manager(tmp_path, CheckpointConfig(every=1, keep=3, async_save=False))
    plain = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=(), rng=jnp.zeros((2,), jnp.uint32))
    ckpt.save(manager, 1, plain, {"stream": {}}, force=True)
    manager.wait_until_finished()
    with_ref = ckpt.abstract_like(plain._replace(ref_params=params))
    with pytest.raises(ConfigError, match=r"checkpoint 1 .* holds no reference params.*kl_beta"):
        ckpt.match_reference(manager, with_ref)
    assert ckpt.match_reference(manager, ckpt.abstract_like(plain)).ref_params is None
    ckpt.save(manager, 2, plain._replace(ref_params=params), {"stream": {}}, force=True)
    manager.wait_until_finished()
    # an old-style checkpoint (with a copy) for a state without one: restore the copy too
    target = ckpt.match_reference(manager, ckpt.abstract_like(plain))
    assert target.ref_params is not None
    step, state, _ = ckpt.restore_latest(manager, target)
    assert step == 2 and float(state.ref_params["w"][0]) == 1.0
    manager.close()
