"""The engine's state in checkpoints: samples in flight, ready groups, counters and the engine RNG
survive a save and a restore (JSON bookkeeping + an orbax item of numpy arrays), the snapshot is a
copy that later (donating) chunks do not touch, and a GRPO run with partial rollouts SIGKILLed
mid-way and resumed logs the same metrics as an uninterrupted run."""

import copy
import dataclasses
import json

import jax
import numpy as np
import pytest
from preset_configs import config_path, overrides
from test_resume import killed_and_resumed_runs, train_in_process

from jaxrl.config import ConfigError, load_config
from jaxrl.data.stream import StreamState
from jaxrl.data.tasks import load_task
from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.policy.warmstart import load_or_train_base
from jaxrl.rollout.sampler import SamplingParams
from jaxrl.sources.groups import EngineSource
from jaxrl.train import checkpoint as ckpt

pytestmark = pytest.mark.usefixtures("persistent_compile_cache")  # training runs repeat programs

# Slots for 8 groups, 4 a step, one decode step a chunk: groups are in flight at every step boundary,
# some with members already read out (finished) while others still decode.
FILL = [
    "rollout.engine.enabled=true",
    "rollout.engine.slots=32",
    "rollout.engine.chunk=1",
    "rollout.engine.admission=fill",
]
TIMING = {"rollout/seconds", "rollout/tokens_per_s", "step_seconds", "wall_time"}


def _cfg(*extra):
    return load_config(config_path("grpo"), overrides("grpo") + FILL + list(extra))


def _warm(cfg):
    tok = CharTokenizer()
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tok.vocab_size)
    task = load_task(cfg.data)
    params, _ = load_or_train_base(cfg, model_cfg, tok, task.train, tok.alphabet, progress=False)
    return model_cfg, tok, task, params


def _saved(state: dict) -> dict:
    """What a checkpoint of `checkpoint_state()` gives back: the JSON part through JSON, the arrays as copies."""
    state = dict(state)
    arrays = state.pop(ckpt.ARRAYS)
    return {**json.loads(json.dumps(state)), ckpt.ARRAYS: copy.deepcopy(arrays)}


def _same_step(a, b):
    assert a.stream == b.stream
    assert sorted(a.host_batch.fields()) == sorted(b.host_batch.fields())
    for k in a.host_batch.fields():
        np.testing.assert_array_equal(a.host_batch.fields()[k], b.host_batch.fields()[k], err_msg=k)
    assert {k: v for k, v in a.metrics.items() if k not in TIMING} == {
        k: v for k, v in b.metrics.items() if k not in TIMING
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, saved_at",
    [((), 2), (("rollout.engine.max_staleness=1", "rollout.engine.reprefill=true"), 5)],
    ids=["unbounded", "bounded-reprefill"],
)
def test_restored_engine_continues_like_the_original(in_process_cache, extra, saved_at):
    # bounded-reprefill: the version that admitted each flight is part of the state (a restore
    # without it restarts different groups).
    cfg = _cfg(*extra)
    model_cfg, tok, task, params = _warm(cfg)
    source = EngineSource(cfg, model_cfg, tok, task, {})
    stream = StreamState(0, 0)
    for step in range(1, saved_at + 1):
        stream = source.produce(params, stream, None, step).stream
    as_given = source.checkpoint_state()  # what the loop hands to the (asynchronous) save
    saved = _saved(as_given)
    host = saved["engine"]
    # The save is meaningful: groups in flight, some with finished members read out (parked rows).
    assert host["flights"] and any(f["members"] for f in host["flights"])
    assert len(saved[ckpt.ARRAYS]["engine"]["parked"]["tokens_RxT"]) > 0
    if extra:
        assert any(f["born"] > 0 for f in host["flights"])

    nxt = saved_at + 1
    straight = [source.produce(params, stream, None, nxt)]  # donates (and on CPU may reuse) the state buffers
    # The arrays given to the save do not alias the device state: the chunks that ran since left them as they were.
    jax.tree.map(np.testing.assert_array_equal, as_given[ckpt.ARRAYS], saved[ckpt.ARRAYS])

    resumed_source = EngineSource(cfg, model_cfg, tok, task, saved)
    resumed = [resumed_source.produce(params, stream, None, nxt)]
    straight.append(source.produce(params, straight[0].stream, None, nxt + 1))
    resumed.append(resumed_source.produce(params, resumed[0].stream, None, nxt + 1))
    for a, b in zip(straight, resumed):
        _same_step(a, b)
    if not extra:
        assert resumed[0].metrics["engine/partial_frac"] > 0  # the step used samples carried over the save
    else:  # carried samples were re-prefilled under a new version and stale groups restarted
        assert sum(r.metrics["engine/reprefilled_samples"] for r in resumed) > 0
        assert sum(r.metrics["engine/restarted_samples"] for r in resumed) > 0


def test_engine_state_of_another_shape_is_a_config_error(in_process_cache):
    cfg = _cfg()
    model_cfg, tok, task, params = _warm(cfg)
    source = EngineSource(cfg, model_cfg, tok, task, {})
    source.produce(params, StreamState(0, 0), None, 1)
    saved = _saved(source.checkpoint_state())
    other = _cfg("rollout.engine.slots=16")
    with pytest.raises(ConfigError, match=r"rollout.engine.slots: .* slots=32, this run 16"):
        EngineSource(other, model_cfg, tok, task, saved)
    with pytest.raises(ConfigError, match="rollout_arrays item is missing"):
        EngineSource(cfg, model_cfg, tok, task, {"engine": saved["engine"]})


def test_engine_state_without_drafting_does_not_load_into_a_drafting_engine():
    # Speculation lengthens each slot's cache by max_draft: the error names the switch, not the model.
    from jaxrl.config import EngineConfig, ModelConfig, SpeculativeConfig
    from jaxrl.rollout.engine.driver import Engine

    model = ModelConfig(vocab_size=29, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)

    def make(spec):
        return Engine(
            model,
            EngineConfig(enabled=True, slots=4),
            group_size=2,
            prompt_len=4,
            sampling=SamplingParams(max_new_tokens=5, temperature=1.0, eos_id=1, pad_id=0),
            rng=jax.random.key(0),
            speculative=spec,
        )

    host, arrays = make(None).to_state()
    drafting = make(SpeculativeConfig(enabled=True, drafter="early_exit", draft_layers=1))
    with pytest.raises(ConfigError, match=r"rollout.speculative.enabled/max_draft: .* caches hold \d+ positions"):
        drafting.load_state(json.loads(json.dumps(host)), arrays)


def test_save_refuses_device_arrays_in_the_arrays_item(tmp_path):
    class State:  # check_finite reads state.params
        params = {"w": jax.numpy.ones(2)}

    manager = ckpt.make_manager(tmp_path, load_config(config_path("grpo")).checkpoint)
    with pytest.raises(TypeError, match=r"rollout_arrays: \['engine'\]\['x'\] is not a numpy array"):
        ckpt.save(manager, 1, State(), {ckpt.ARRAYS: {"engine": {"x": jax.numpy.ones(2)}}})
    manager.close()


# Every step of this run has groups in flight and, from step 2 on, tokens a version old: a kill at
# checkpoint 2 (of 6) resumes mid-run from a state with carried groups, at a cost of 6 steps a run.
STEPS = 6
RUN_ARGS = [
    str(config_path("grpo")),
    *sum((["--set", t] for t in overrides("grpo") + FILL), []),
    "--set",
    f"train.steps={STEPS}",
    "--set",
    "checkpoint.every=1",
]


@pytest.mark.slow
def test_sigkilled_run_with_partial_rollouts_resumes_to_the_same_metrics(tmp_path, cache_env):
    reference = train_in_process(RUN_ARGS, tmp_path / "straight", cache_env)
    assert sorted(reference) == list(range(STEPS + 1))
    # Only the kill needs a process of its own: the resume runs here, reusing the programs the
    # straight run compiled (the same metrics bit for bit: train_in_process has the children's policy).
    before, resumed, restored = killed_and_resumed_runs(
        RUN_ARGS, tmp_path / "killed", cache_env, STEPS, kill_at=2, resume_in_process=True
    )
    for step in range(restored + 1):  # a resume, not a fresh start: the rows it restored from are kept as written
        assert resumed[step] == before[step]
    # Groups were in flight at the checkpoint the run resumed from, and the next step used samples
    # drawn before it (tokens a version old: carried groups; partial_frac > 0 only on alternate steps here).
    assert reference[restored]["engine/in_flight_groups"] > 0
    assert reference[restored + 1]["engine/staleness_max"] >= 1
    for step in range(1, STEPS + 1):

        def untimed(row):
            return {k: v for k, v in row.items() if k not in TIMING}

        assert untimed(resumed[step]) == untimed(reference[step]), step


@pytest.mark.slow
def test_checkpoint_without_engine_state_resumes_with_the_engine(tmp_path, in_process_cache):
    """A run switched to the engine (an allowed config change) starts the engine empty at the
    restored stream position; switched back, the engine's saved state is ignored."""
    from jaxrl.train.loop import train

    workdir = tmp_path / "run"
    static = load_config(config_path("grpo"), overrides("grpo") + ["train.steps=1", "checkpoint.every=1"])
    train(static, workdir)
    rows = train(_cfg("train.steps=2", "checkpoint.every=1"), workdir, allow_config_change=True)
    assert [r["step"] for r in rows] == [0, 1, 2] and "engine/chunks" not in rows[1]
    assert rows[2]["engine/chunks"] > 0 and rows[2]["engine/partial_frac"] == 0  # nothing was carried in
    host = json.loads((workdir / "checkpoints" / "2" / "host" / "metadata").read_text())
    assert host["engine"]["flights"]  # the engine's samples in flight were saved
    rows = train(
        dataclasses.replace(static, train=dataclasses.replace(static.train, steps=3)), workdir, allow_config_change=True
    )
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and "engine/chunks" not in rows[3]
