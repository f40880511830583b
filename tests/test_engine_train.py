"""The slot engine as the training loop's rollout source (`rollout.engine.enabled=true`):
EngineSource scores each group against its own record, walks the data stream one prompt per
admitted group, records versions across steps (partial rollouts with `admission=fill`), and a
GRPO run trains with it."""

import dataclasses
import math

import jax
import numpy as np
import pytest
from preset_configs import config_path, overrides

from jaxrl.config import ConfigError, load_config
from jaxrl.data.rewards import score
from jaxrl.data.stream import StreamState
from jaxrl.data.tasks import load_task
from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.models.transformer import init_params
from jaxrl.policy.warmstart import load_or_train_base
from jaxrl.sources.groups import EngineSource, PromptFeed, engine_metrics

pytestmark = pytest.mark.usefixtures("persistent_compile_cache")  # training runs repeat programs


def _cfg(*extra):
    return load_config(config_path("grpo"), overrides("grpo") + ["rollout.engine.enabled=true", *extra])


def _source(cfg, in_process_cache, warm=False):
    """(EngineSource, task, tokenizer, params): random params, or the (session-cached) warm start,
    whose completions end with EOS after varying lengths."""
    tok = CharTokenizer()
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tok.vocab_size)
    task = load_task(cfg.data)
    if warm:
        params, _ = load_or_train_base(cfg, model_cfg, tok, task.train, tok.alphabet, progress=False)
    else:
        params = init_params(model_cfg, jax.random.key(0))
    return EngineSource(cfg, model_cfg, tok, task, {}), task, tok, params


def test_prompt_feed_walks_the_stream_one_prompt_at_a_time(in_process_cache):
    cfg = _cfg()
    task, tok = load_task(cfg.data), CharTokenizer()
    feed = PromptFeed(task.train, StreamState(0, 0), tok, cfg)
    items = [next(feed) for _ in range(5)]
    assert feed.stream == StreamState(0, 5) and feed.skipped == 0
    for record, tokens in items:  # the record's prompt, unpadded
        assert tok.decode(tokens.tolist()) == record["prompt"]


def test_engine_source_scores_each_group_against_its_own_record(in_process_cache):
    cfg = _cfg("rollout.engine.slots=8", "rollout.engine.admission=exact")
    source, task, tok, params = _source(cfg, in_process_cache)
    N, G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    produced = source.produce(params, StreamState(0, 0), None, step=1)
    batch = produced.host_batch.fields()
    assert produced.stream == StreamState(0, N)  # exact admission: one prompt per group the step needs
    np.testing.assert_array_equal(batch["group_id_B"], np.repeat(np.arange(N), G))
    # Re-score every row against the record its group's prompt came from (found by its prompt text).
    by_prompt = {task.train[i]["prompt"]: task.train[i] for i in range(len(task.train))}
    texts = [tok.decode(t.tolist()) for t in batch["tokens_BxT"]]
    prompts = [tok.decode(p[m > 0].tolist()) for p, m in zip(batch["prompt_tokens_BxP"], batch["prompt_mask_BxP"])]
    expected, _ = score(task.verifier, texts, list(batch["truncated_B"] == 0), [by_prompt[p] for p in prompts])
    np.testing.assert_array_equal(batch["rewards_BxK"], expected)
    assert batch["tokens_BxT"].shape == (N * G, cfg.rollout.max_new_tokens) and "version_BxT" not in batch
    assert produced.metrics["engine/staleness_0"] == 1.0 and produced.metrics["engine/partial_frac"] == 0.0


def test_fill_admission_carries_samples_into_the_next_step_with_their_versions(in_process_cache):
    # chunk=1 and more slots than a step needs: samples still decoding when a step has its groups
    # continue under the next version; their tokens record both versions.
    cfg = _cfg("rollout.engine.slots=32", "rollout.engine.chunk=1", "rollout.engine.admission=fill")
    source, task, tok, params = _source(cfg, in_process_cache, warm=True)
    stream, carried, spans = StreamState(0, 0), 0, 0.0
    for step in (1, 2, 3):
        produced = source.produce(params, stream, None, step)
        assert produced.stream.index >= stream.index
        stream = produced.stream
        carried += produced.metrics["engine/in_flight_groups"]
        spans += produced.metrics["engine/partial_frac"]
    assert carried > 0 and spans > 0  # some groups outlived a step and some samples spanned versions
    assert stream.index > 2 * cfg.rollout.prompts_per_step  # freed slots were refilled from the stream


def test_engine_metrics_staleness_by_hand():
    from jaxrl.rollout.engine.groups import Group

    class Counts:
        counts = {"chunks": 7, "prefill_calls": 3}
        groups_in_flight = 2

    v = np.array([[2, 2, 3, -1], [3, 3, -1, -1]], np.int32)  # step version 3: staleness 1,1,0 and 0,0
    g = Group(0, None, None, None, None, None, v, None, None, None)
    m = engine_metrics(Counts(), {"chunks": 5, "prefill_calls": 1}, [g], version=3)
    assert m["engine/chunks"] == 2 and m["engine/prefill_calls"] == 2 and m["engine/in_flight_groups"] == 2
    assert m["engine/partial_frac"] == 0.5  # row 0 spans versions 2 and 3
    assert m["engine/staleness_mean"] == pytest.approx(2 / 5) and m["engine/staleness_max"] == 1
    assert (m["engine/staleness_0"], m["engine/staleness_1"], m["engine/staleness_2+"]) == (0.6, 0.4, 0.0)


@pytest.mark.slow
def test_grpo_trains_with_the_engine(tmp_path, in_process_cache):
    from jaxrl.train.loop import train

    cfg = _cfg("rollout.engine.slots=8", "rollout.engine.admission=fill")
    rows = train(cfg, tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["mismatch_abs_logp"] < 0.05  # recorded log-probs = the trainer's (same params)
        for key in ("engine/chunks", "engine/staleness_mean", "rollout/tokens_per_s", "reward/mean"):
            assert math.isfinite(row[key]), key


def test_engine_shares_that_do_not_divide_over_processes_are_config_errors(in_process_cache, monkeypatch):
    """Several processes split prompts_per_step and slots: each must divide, each share hold a group."""
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    cases = [
        (_cfg("rollout.prompts_per_step=4"), "rollout.prompts_per_step=4 does not divide over the run's 3 processes"),
        (_cfg("rollout.prompts_per_step=3", "rollout.engine.slots=16"), "rollout.engine.slots=16 does not divide"),
        (
            _cfg("rollout.prompts_per_step=3", "rollout.engine.slots=9", "rollout.group_size=4"),
            "rollout.engine.slots=9: 3 per process over 3 processes, expected at least group_size=4 each",
        ),
    ]
    for cfg, message in cases:
        with pytest.raises(ConfigError, match=message):
            EngineSource(cfg, cfg.model, CharTokenizer(), None, {}, param_sh={})
