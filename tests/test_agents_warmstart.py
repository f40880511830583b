"""The multi-turn warm start (jaxrl.agents.warmstart): teacher episodes as SFT batches (prompt left-padded,
loss on the model's tokens only, EOS after a final answer), observation tokens with exactly zero
gradient, a few SFT steps that learn, and the warm-start cache key of agent tasks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl.agents.env import AGENT_ALPHABET
from jaxrl.agents.warmstart import episode_targets, suite_fingerprint, teacher_batch
from jaxrl.config import AgentConfig, Config, ConfigError, DataConfig, ModelConfig, RolloutConfig, WarmStartConfig
from jaxrl.data.registry import get_task
from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.models.transformer import init_params
from jaxrl.policy.warmstart import cache_key, make_sft_step, sft_loss, train_base

TOK = CharTokenizer(AGENT_ALPHABET)
SUITE = get_task("agent_gridworld").suite
MODEL = ModelConfig(
    vocab_size=TOK.vocab_size,
    d_model=32,
    n_layers=1,
    n_heads=2,
    n_kv_heads=1,
    head_dim=16,
    mlp_dim=64,
    max_seq_len=24 + 136,
)
P, T = 24, 136  # data.max_prompt_len, rollout.max_new_tokens of the gridworld config


def _ids(text):
    return TOK.encode(text)


def test_episode_targets_by_hand():
    segments = [("up]", True), ("ab\n", False), ("left]", True)]
    tokens_T, mask_T, cut = episode_targets(TOK, segments, "]", 16)
    # 3 + 3 + 5 = 11 tokens; the last model segment ends the turn ("]"): no EOS; PAD up to 16.
    assert tokens_T.tolist() == _ids("up]ab\nleft]") + [TOK.pad_id] * 5 and not cut
    assert mask_T.tolist() == [1] * 3 + [0] * 3 + [1] * 5 + [0] * 5
    # A final answer (a model segment without "]") is ended by EOS, which is trained on.
    tokens_T, mask_T, _ = episode_targets(TOK, [("c]", True), ("7\n", False), ("42", True)], "]", 8)
    assert tokens_T.tolist() == _ids("c]7\n42") + [TOK.eos_id, TOK.pad_id]
    assert mask_T.tolist() == [1, 1, 0, 0, 1, 1, 1, 0]
    # An episode that ends on an observation (the teacher's turn limit): no EOS.
    tokens_T, mask_T, _ = episode_targets(TOK, [("up]", True), ("..\n", False)], "]", 6)
    assert tokens_T.tolist() == _ids("up]..\n") and mask_T.tolist() == [1, 1, 1, 0, 0, 0]
    # Longer than the budget: cut there, and counted when a model token is lost ...
    tokens_T, mask_T, cut = episode_targets(TOK, segments, "]", 5)
    assert tokens_T.tolist() == _ids("up]ab") and mask_T.tolist() == [1, 1, 1, 0, 0] and cut
    # ... but not when only a trailing observation (context, no loss) is.
    assert not episode_targets(TOK, [("up]", True), ("..\n", False)], "]", 4)[2]


def test_teacher_batch_left_pads_the_prompt_and_masks_out_observations():
    records = SUITE.records("train", 8, 0)
    batch, cut = teacher_batch(SUITE, records, TOK, P, T, 0.3, np.random.default_rng(0))
    assert batch["prompt_tokens_BxP"].shape == (8, P) and batch["tokens_BxT"].shape == (8, T) and cut == 0
    for b, record in enumerate(records):
        # BOS + the 20-character grid, right-aligned in 24 columns: 3 columns of left padding.
        first = SUITE.make(AgentConfig()).reset(record, np.random.default_rng(0))
        assert batch["prompt_mask_BxP"][b].tolist() == [False] * 3 + [True] * 21
        assert batch["prompt_tokens_BxP"][b].tolist() == [TOK.pad_id] * 3 + [TOK.bos_id] + _ids(first)
        tokens, mask = batch["tokens_BxT"][b], batch["completion_mask_BxT"][b]
        assert TOK.eos_id not in tokens.tolist()  # gridworld episodes end by the env, never by EOS
        # Runs of equal mask: the model's runs are moves ending in "]", the others whole grids (4 rows).
        edges = [0] + [t for t in range(1, T) if mask[t] != mask[t - 1]] + [T]
        for lo, hi in zip(edges, edges[1:]):
            text = TOK.decode(tokens[lo:hi])
            if mask[lo] == 1:
                assert text.endswith("]") and text.count("]") >= 1
                assert all(m in ("up", "down", "left", "right") for m in text.split("]")[:-1])
            elif tokens[lo] != TOK.pad_id and (hi < T or tokens[T - 1] == TOK.pad_id):  # a last grid may be cut
                assert text.count("\n") % 4 == 0 and "p" in text and "]" not in text, text


def test_teacher_batch_needs_the_agent_alphabet():
    with pytest.raises(ConfigError, match="AGENT_ALPHABET"):
        teacher_batch(SUITE, SUITE.records("train", 2, 0), CharTokenizer(), P, T, 0.0, np.random.default_rng(0))


def _logp_from_logits(logits_BxTxV, tokens_BxT):
    logp_all = jax.nn.log_softmax(logits_BxTxV, axis=-1)
    return jnp.take_along_axis(logp_all, tokens_BxT[..., None], axis=-1)[..., 0]


def test_observation_positions_get_exactly_zero_gradient():
    records = SUITE.records("train", 4, 0)
    batch, _ = teacher_batch(SUITE, records, TOK, P, T, 0.3, np.random.default_rng(1))
    tokens_BxT, mask_BxT = jnp.asarray(batch["tokens_BxT"]), jnp.asarray(batch["completion_mask_BxT"])
    logits_BxTxV = jax.random.normal(jax.random.key(0), tokens_BxT.shape + (TOK.vocab_size,))
    grad_BxTxV = jax.grad(lambda lg: sft_loss(_logp_from_logits(lg, tokens_BxT), mask_BxT))(logits_BxTxV)
    per_position_BxT = np.abs(np.asarray(grad_BxTxV)).sum(-1)
    observation_BxT = (np.asarray(mask_BxT) == 0) & (np.asarray(tokens_BxT) != TOK.pad_id)
    assert observation_BxT.sum() > 100  # the batch does hold observation tokens
    assert np.all(per_position_BxT[observation_BxT] == 0.0)
    assert np.all(per_position_BxT[np.asarray(mask_BxT) == 1] > 0)  # ... and the model's tokens do learn


@pytest.mark.slow
def test_the_sft_step_loss_ignores_an_observation_target():
    # An episode cut by the turn limit ends on an observation; changing its last token changes only the
    # target at that (masked-out) position, so the SFT step's loss is bit-for-bit the same.
    segments = [("up]", True), ("....\n.p..\n", False)]
    tokens_T, mask_T, _ = episode_targets(TOK, segments, "]", 16)
    prompt_BxP, pmask_BxP = np.zeros((1, 4), np.int32), np.array([[False, False, True, True]])
    prompt_BxP[0, 2:] = [TOK.bos_id] + _ids("p")
    params = init_params(MODEL, jax.random.key(0))
    optimizer = optax.adam(1e-3)
    step = make_sft_step(MODEL, optimizer)
    losses = []
    for last in ("\n", "#"):
        tok = tokens_T.copy()
        tok[len("up]....\n.p..\n") - 1] = _ids(last)[0]
        batch = {
            "prompt_tokens_BxP": prompt_BxP,
            "prompt_mask_BxP": pmask_BxP,
            "tokens_BxT": tok[None],
            "completion_mask_BxT": mask_T[None],
        }
        losses.append(float(step(params, optimizer.init(params), batch)[2]))
    assert losses[0] == losses[1]
    # A model token's target does count: "up]" -> "dn]" changes the loss.
    tok = tokens_T.copy()
    tok[:2] = _ids("dn")
    batch = {
        "prompt_tokens_BxP": prompt_BxP,
        "prompt_mask_BxP": pmask_BxP,
        "tokens_BxT": tok[None],
        "completion_mask_BxT": mask_T[None],
    }
    assert float(step(params, optimizer.init(params), batch)[2]) != losses[0]


@pytest.mark.slow
def test_a_few_sft_steps_on_teacher_episodes_lower_the_loss():
    batch, _ = teacher_batch(SUITE, SUITE.records("train", 16, 0), TOK, P, T, 0.3, np.random.default_rng(2))
    params = init_params(MODEL, jax.random.key(1))
    optimizer = optax.adam(3e-3)
    opt_state, step = optimizer.init(params), make_sft_step(MODEL, optimizer)
    losses = []
    for _ in range(15):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 1.0, losses


def _agent_cfg(**warmstart):
    return Config(
        model=MODEL,
        data=DataConfig(task="agent_gridworld", num_train=40, num_test=8, max_prompt_len=P),
        rollout=RolloutConfig(max_new_tokens=T),
        warmstart=WarmStartConfig(steps=2, batch_size=4, **warmstart),
    )


def test_train_base_on_an_agent_task_uses_the_teacher_episodes():
    cfg = _agent_cfg()
    train, test = get_task(cfg.data.task).split_records(cfg.data)
    assert len(train) == 40 and len(test) == 8 and train == SUITE.records("train", 40, 0)
    params = train_base(cfg, MODEL, TOK, train, progress=False)
    assert jax.tree.structure(params) == jax.tree.structure(init_params(MODEL, jax.random.key(0)))


def test_cache_key_of_an_agent_task_names_the_suite_and_the_teacher(monkeypatch):
    key = cache_key(_agent_cfg(), MODEL, TOK.alphabet)
    assert key != cache_key(_agent_cfg(teacher_error=0.4), MODEL, TOK.alphabet)
    other_task = dataclasses.replace(_agent_cfg(), data=dataclasses.replace(_agent_cfg().data, task="agent_calculator"))
    monkeypatch.setattr("jaxrl.policy.warmstart.suite_fingerprint", lambda suite: "same")
    monkeypatch.setattr("jaxrl.policy.warmstart.get_task", lambda task: get_task("agent_gridworld"))
    assert cache_key(other_task, MODEL, TOK.alphabet) != cache_key(_agent_cfg(), MODEL, TOK.alphabet)  # data.task
    monkeypatch.undo()
    # The environment's behaviour is in the key: a different teacher (here: one that never moves
    # towards the goal) changes the suite's fingerprint.
    before = suite_fingerprint(SUITE)
    monkeypatch.setattr("jaxrl.agents.gridworld.best_move", lambda rows, pos: "up")
    assert suite_fingerprint(SUITE) != before
    monkeypatch.setattr("jaxrl.policy.warmstart.suite_fingerprint", lambda suite: "changed")
    assert cache_key(_agent_cfg(), MODEL, TOK.alphabet) != key
