"""`rollout.engine.allocation=vigor` in the training loop's EngineSource: a step's B samples are
allocated to its prompts by reward variance (jaxrl.sources.vigor), the batch has exactly B rows,
one group id per prompt, groups of unequal size, and a GRPO run trains with it."""

import dataclasses
import math

import numpy as np
import pytest
from test_engine_train import _cfg, _source

from jaxrl import config as C
from jaxrl.config import ConfigError
from jaxrl.data.rewards import score
from jaxrl.data.stream import StreamState
from jaxrl.sources.groups import EngineSource, PromptFeed

pytestmark = pytest.mark.usefixtures("persistent_compile_cache")  # training runs repeat programs

VIGOR = ["rollout.engine.slots=8", "rollout.engine.allocation=vigor", "rollout.engine.initial_samples=2"]


def _coin_verifier(text, finished, record):
    """A reward that random params make a near coin flip (their completions are near-uniform
    characters), so that groups differ in variance; the warm start's correctness is 0 almost
    everywhere on this tiny run. Format reward: 0 (the preset's weights ignore it)."""
    return float(len(text) > 0 and ord(text[0]) % 2 == 0), 0.0


def test_vigor_step_has_b_rows_one_group_per_prompt_and_unequal_sizes(in_process_cache):
    # grpo test preset: 4 prompts x G=4 -> B = 16; n0 = 2 each (8), 8 more over 2 rounds, cap 8.
    cfg = _cfg(*VIGOR)
    _, task, tok, params = _source(cfg, in_process_cache)
    task = dataclasses.replace(task, verifier=_coin_verifier)
    source = EngineSource(cfg, dataclasses.replace(cfg.model, vocab_size=tok.vocab_size), tok, task, {})
    N, G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    produced = source.produce(params, StreamState(0, 0), None, step=1)
    batch, m = produced.host_batch.fields(), produced.metrics
    assert produced.stream == StreamState(0, N)  # one prompt per group
    assert batch["tokens_BxT"].shape[0] == N * G and len(batch["group_id_B"]) == N * G
    ids, sizes = np.unique(batch["group_id_B"], return_counts=True)
    assert ids.tolist() == list(range(N)) and np.all(np.diff(batch["group_id_B"]) >= 0)  # contiguous groups
    assert sizes.min() >= 2 and sizes.max() <= 2 * G and sizes.min() < sizes.max()
    assert (m["engine/vigor_min_group"], m["engine/vigor_max_group"]) == (sizes.min(), sizes.max())
    assert m["engine/vigor_draws"] == 3 and m["rollout/samples"] == N * G  # phase 1 + 2 rounds; B drawn in all
    # Every row of a group carries its prompt; groups are distinct stream records, rescored alike.
    prompts = [tok.decode(p[k > 0].tolist()) for p, k in zip(batch["prompt_tokens_BxP"], batch["prompt_mask_BxP"])]
    by_group = [{prompts[r] for r in np.flatnonzero(batch["group_id_B"] == g)} for g in ids]
    assert all(len(s) == 1 for s in by_group)
    feed = PromptFeed(task.train, StreamState(0, 0), tok, cfg)
    records = [next(feed)[0] for _ in range(N)]  # the stream's first N prompts, in order
    assert [s.pop() for s in by_group] == [r["prompt"] for r in records]
    by_prompt = {r["prompt"]: r for r in records}
    texts = [tok.decode(t.tolist()) for t in batch["tokens_BxT"]]
    expected, _ = score(task.verifier, texts, list(batch["truncated_B"] == 0), [by_prompt[p] for p in prompts])
    np.testing.assert_array_equal(batch["rewards_BxK"], expected)
    # The group that got the most samples has rewards that vary (its extra samples were earned).
    correct = batch["rewards_BxK"][:, 0]
    biggest = ids[np.argmax(sizes)]
    assert len(set(correct[batch["group_id_B"] == biggest].tolist())) > 1
    assert m["engine/staleness_0"] == 1.0


@pytest.mark.slow
def test_grpo_trains_with_vigor(tmp_path, in_process_cache):
    from jaxrl.train.loop import train

    rows = train(_cfg(*VIGOR), tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["mismatch_abs_logp"] < 0.05  # recorded log-probs = the trainer's (same params)
        for key in ("engine/vigor_max_group", "engine/vigor_informative_frac", "reward/mean"):
            assert math.isfinite(row[key]), key


@pytest.mark.parametrize(
    "items, needle",
    [
        (["rollout.engine.allocation=best"], "rollout.engine.allocation: got 'best', expected 'uniform' or 'vigor'"),
        (["rollout.engine.allocation=vigor"], "rollout.engine.allocation: got 'vigor', expected 'uniform' unless"),
        (
            VIGOR[1:] + ["rollout.engine.enabled=true", "rollout.engine.initial_samples=8"],
            "rollout.engine.initial_samples: got 8, expected 1..group_size-1=7",
        ),
        (
            VIGOR[1:] + ["rollout.engine.enabled=true", "rollout.engine.max_group_samples=4"],
            "rollout.engine.max_group_samples: got 4, expected 0 (2 * group_size) or at least group_size=8",
        ),
        (
            VIGOR[1:] + ["rollout.engine.enabled=true", "rollout.engine.admission=fill"],
            "rollout.engine.admission: got 'fill', expected 'exact' with allocation=vigor",
        ),
        (
            VIGOR[1:] + ["rollout.engine.enabled=true", "rollout.engine.dynamic_sampling=true"],
            "rollout.engine.dynamic_sampling: got True, expected false with allocation=vigor",
        ),
        (["rollout.engine.allocation_rounds=0"], "rollout.engine.allocation_rounds: got 0"),
    ],
)
def test_vigor_config_errors_name_the_field(items, needle):
    with pytest.raises(ConfigError) as e:
        C.apply_overrides(C.Config(), items).validate()
    assert needle in str(e.value) and "\n" not in str(e.value)
