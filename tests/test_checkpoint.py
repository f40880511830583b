"""Checkpoints that no longer restore are set aside (never deleted) and the run resumes from the newest
one that does; non-finite parameters are never saved."""

import sys
import threading
import types

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import CheckpointConfig
from jaxrl.train import checkpoint as ckpt
from jaxrl.train.state import TrainState

# Orbax leaves the cancelled reads of a failed restore as never-awaited coroutines: noise, not a fault.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _weights(step: int, width: int = 4096) -> np.ndarray:
    """Incompressible (random) and big enough to be a data file of its own in the checkpoint."""
    return np.random.default_rng(step).standard_normal(width).astype(np.float32)


def _state(step: int, width: int = 4096) -> TrainState:
    return TrainState(
        step=jnp.asarray(step, jnp.int32),
        params={"w": jnp.asarray(_weights(step, width))},
        opt_state={},
        rng=jnp.zeros((2,), jnp.uint32),
    )


def _saved_run(workdir, steps=(1, 2, 3), keep=3):
    manager = ckpt.make_manager(workdir, CheckpointConfig(keep=keep, async_save=False))
    for s in steps:
        ckpt.save(manager, s, _state(s), {"stream": {"epoch": 0, "index": s}}, force=True)
    manager.wait_until_finished()
    return manager


def _truncate_largest_array_file(step_dir):
    files = [p for p in (step_dir / "state").glob("ocdbt.process_*/d/*")]
    victim = max(files, key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[:1])


def test_unreadable_newest_falls_back_and_is_kept(tmp_path, capsys):
    manager = _saved_run(tmp_path)
    _truncate_largest_array_file(tmp_path / "checkpoints" / "3")
    manager.close()

    manager = ckpt.make_manager(tmp_path, CheckpointConfig(keep=3, async_save=False))
    step, state, host = ckpt.restore_latest(manager, ckpt.abstract_like(_state(0)))
    assert step == 2 and host["stream"]["index"] == 2
    np.testing.assert_array_equal(np.asarray(state.params["w"]), _weights(2))
    err = capsys.readouterr().err
    assert "checkpoint step 3 could not be restored" in err and "resuming from step 2" in err
    assert len(err.strip().splitlines()) == 1
    aside = tmp_path / ckpt.UNREADABLE / "3"
    assert aside.is_dir()  # kept, out of the manager's reach
    # The run goes on: step 3 is saved again, and rotation (keep=3) never touches the set-aside copy.
    for s in (3, 4, 5):
        ckpt.save(manager, s, _state(s), {"stream": {"epoch": 0, "index": s}}, force=True)
    manager.wait_until_finished()
    assert sorted(manager.all_steps()) == [3, 4, 5]
    assert aside.is_dir()
    # A second unreadable step 3 does not overwrite the first one set aside.
    _truncate_largest_array_file(tmp_path / "checkpoints" / "5")
    manager.close()
    manager = ckpt.make_manager(tmp_path, CheckpointConfig(keep=3, async_save=False))
    assert ckpt.restore_latest(manager, ckpt.abstract_like(_state(0)))[0] == 4
    assert sorted(p.name for p in (tmp_path / ckpt.UNREADABLE).iterdir()) == ["3", "5"]


def test_a_failed_restores_stray_reads_stay_silent(tmp_path, capsys, monkeypatch):
    """The reads a failed restore leaves in flight surface later, at no fixed time (the garbage collector,
    orbax's closing event loop: in about 1 run in 6 of this setup as a child process), each as a
    traceback holding a TensorStore spec. After a failed restore they are dropped; anything else still
    reaches the hook it went to before."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)  # stands in for Python's printer
    monkeypatch.setattr(threading, "excepthook", seen.append)
    monkeypatch.setattr(ckpt, "_noise_dropped", False)
    manager = _saved_run(tmp_path)
    _truncate_largest_array_file(tmp_path / "checkpoints" / "3")
    manager.close()
    manager = ckpt.make_manager(tmp_path, CheckpointConfig(keep=3, async_save=False))
    assert ckpt.restore_latest(manager, ckpt.abstract_like(_state(0)))[0] == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    read = Exception("Encountered error while reading array index: (). See full TensorStore details: {...}")
    closed, other = RuntimeError("Event loop is closed"), ValueError("something else")
    for exc in (read, closed, other):
        sys.unraisablehook(types.SimpleNamespace(exc_value=exc, object=None))
        threading.excepthook(types.SimpleNamespace(exc_value=exc, thread=None))
    assert [u.exc_value for u in seen] == [other, other]


def test_nothing_restorable_moves_nothing(tmp_path):
    _saved_run(tmp_path).close()
    manager = ckpt.make_manager(tmp_path, CheckpointConfig(keep=3, async_save=False))
    # Another shape fails on every step (a config that does not fit): an error, and every step stays.
    with pytest.raises(ckpt.CheckpointError, match=r"could be restored; the newest, step 3: "):
        ckpt.restore_latest(manager, ckpt.abstract_like(_state(0, width=4097)))
    assert sorted(manager.all_steps()) == [1, 2, 3]
    assert not (tmp_path / ckpt.UNREADABLE).exists()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_params_are_never_saved(tmp_path, bad):
    manager = _saved_run(tmp_path, steps=(1,))
    state = _state(2)
    state = state._replace(params={"w": state.params["w"].at[1].set(bad)})
    with pytest.raises(ckpt.NonFiniteError, match=r"step 2: the parameters hold NaN/inf"):
        ckpt.save(manager, 2, state, {"stream": {}}, force=True)
    manager.wait_until_finished()
    assert list(manager.all_steps()) == [1]


def _restored_weights(manager, step: int, like: TrainState) -> np.ndarray:
    manager.reload()
    restored = ckpt._restore(manager, step, ckpt.abstract_like(like))[1]
    return np.asarray(restored.params["w"])


def test_background_save_keeps_the_state_as_it_was_when_saved(tmp_path, monkeypatch):
    """The loop donates the state to the next update right after saving it: the background save must
    write the values of the moment `save` was called, not what the donated buffers hold later. The
    saving thread is held until the next update has run, so the order is certain."""
    import threading

    import jax

    overwritten = threading.Event()
    original = ckpt.save

    def held_save(*args, **kw):
        assert overwritten.wait(timeout=60)
        return original(*args, **kw)

    monkeypatch.setattr(ckpt, "save", held_save)
    saver = ckpt.BackgroundSaver(ckpt.make_manager(tmp_path, CheckpointConfig(keep=3, async_save=True)))
    assert saver.background
    overwrite = jax.jit(lambda s: s._replace(params={"w": s.params["w"] * 0 - 7.0}), donate_argnums=0)
    state = _state(1)
    saver.save(1, state, {"stream": {"epoch": 0, "index": 1}}, force=True)
    state = jax.block_until_ready(overwrite(state))  # the next step overwrites the buffers it was given
    overwritten.set()
    saver.save(2, state, {"stream": {"epoch": 0, "index": 2}}, force=True)
    saver.close()
    np.testing.assert_array_equal(_restored_weights(saver.manager, 1, state), _weights(1))
    np.testing.assert_array_equal(_restored_weights(saver.manager, 2, state), np.full(4096, -7.0, np.float32))


def test_background_save_errors_reach_the_loop(tmp_path):
    """An error raised on the saving thread is raised again on the loop's next save (or its close)."""
    saver = ckpt.BackgroundSaver(ckpt.make_manager(tmp_path, CheckpointConfig(keep=3, async_save=True)))
    saver.save(1, _state(1), {ckpt.ARRAYS: {"x": [1, 2]}}, force=True)  # not numpy: save raises TypeError
    with pytest.raises(TypeError, match="rollout_arrays.*not a numpy array"):
        saver.save(2, _state(2), {"stream": {}}, force=True)
    with pytest.raises(ckpt.NonFiniteError, match="step 3"):  # checked on the loop's thread, at once
        saver.save(3, _state(3)._replace(params={"w": jnp.full((4,), jnp.nan)}), {"stream": {}}, force=True)
    saver.close()
    assert ckpt.restore_latest(saver.manager, ckpt.abstract_like(_state(1))) is None
