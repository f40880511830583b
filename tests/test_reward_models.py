"""Reward models and generative judges (jaxrl.rewards): the Bradley-Terry loss by hand, the score read at
the last live token, pair files' errors naming file and line, a tiny reward model learning a hidden
preference through `jaxrl reward-model train` (held-out pair accuracy >= 0.9) and resuming exactly, its
use as a batched reward column in scoring, and a judge whose verdicts parse or score 0 and are counted,
batched on the slot engine exactly as when judged one at a time."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO

from jaxrl import cli
from jaxrl.config import Config, ConfigError, ModelConfig, apply_overrides, load_config
from jaxrl.data.rewards import verify_arithmetic
from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.models.decoder import positions_from_mask, run_decoder
from jaxrl.models.transformer import init_params
from jaxrl.rewards import scorer as scorer_module
from jaxrl.rewards.judge import Judge, JudgeScorer, JudgeVerifier, judge_metrics, parse_verdict
from jaxrl.rewards.model import (
    bradley_terry_loss,
    encode_sequences,
    init_reward_model,
    pair_loss,
    sequence_scores,
)
from jaxrl.rewards.pairs import carry_dropped, even_last_rule, read_pairs, synthetic_pairs, tokenize_pairs
from jaxrl.rewards.scorer import RewardModelScorer, RewardModelVerifier, load_scorer
from jaxrl.sources.scoring import reward_metrics, score_completions

TOK = CharTokenizer()
TINY_MODEL = ModelConfig(
    d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64, max_seq_len=16, vocab_size=TOK.vocab_size
)
RM_TINY = [
    *("model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16"),
    *("model.mlp_dim=64", "model.max_seq_len=16", "reward_model.synthetic=even_last", "reward_model.init=scratch"),
    *("reward_model.num_train=256", "reward_model.num_test=128", "reward_model.batch_size=32"),
    *("reward_model.learning_rate=3e-3", "reward_model.eval_every=20", "reward_model.checkpoint_every=20"),
    "reward_model.progress=false",
]


def test_bradley_terry_loss_by_hand():
    chosen, rejected = jnp.array([2.0, 0.0, -1.0]), jnp.array([0.0, 1.0, -1.0])
    loss, metrics = bradley_terry_loss(chosen, rejected)
    # -log sigmoid(m) = log(1 + exp(-m)) for margins 2, -1, 0
    expected = (math.log1p(math.exp(-2.0)) + math.log1p(math.exp(1.0)) + math.log(2.0)) / 3
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert float(metrics["accuracy"]) == pytest.approx(1 / 3)  # only a strictly positive margin is right
    assert float(metrics["margin"]) == pytest.approx(1 / 3)


def test_score_is_the_head_on_the_last_live_token_whatever_the_padding():
    params = init_reward_model(TINY_MODEL, jax.random.key(0))
    narrow = encode_sequences(TOK, ["12+3="], ["15"], 10, truncate=False)
    wide = encode_sequences(TOK, ["12+3="], ["15"], 16, truncate=False)
    s_narrow = float(sequence_scores(params, TINY_MODEL, *narrow)[0])
    s_wide = float(sequence_scores(params, TINY_MODEL, *wide)[0])
    assert s_narrow == pytest.approx(s_wide, abs=1e-5)  # left padding is invisible
    # By hand: the final normed hidden state at the last slot (the EOS), dotted with the head.
    tokens, mask = wide
    live = jnp.asarray(mask)
    positions = positions_from_mask(live)
    hidden, _, _ = run_decoder(params["backbone"], TINY_MODEL, tokens, positions, live, return_hidden=True)
    by_hand = float(hidden[0, -1] @ params["head"]["w_D"] + params["head"]["b"])
    assert s_wide == pytest.approx(by_hand, abs=1e-5)
    assert tokens[0, -1] == TOK.eos_id and tokens[0, 0] == TOK.pad_id
    # A right-padded row (live tokens then padding) reads its last live token, not the last slot.
    right = np.roll(tokens, -3, axis=1), np.roll(mask, -3, axis=1)
    assert float(sequence_scores(params, TINY_MODEL, *right)[0]) == pytest.approx(s_wide, abs=1e-5)
    with pytest.raises(ValueError, match="row 0 has 9 tokens, more than the model's 8"):
        encode_sequences(TOK, ["12+3="], ["15"], 8, truncate=False)


def test_pair_loss_scores_both_sides_in_one_forward():
    params = init_reward_model(TINY_MODEL, jax.random.key(1))
    train, _ = synthetic_pairs("arithmetic", 2, 8, 2, 0)
    pairs = tokenize_pairs(train, TOK, 16, "reward_model.synthetic")
    loss, metrics = pair_loss(params, TINY_MODEL, pairs)
    chosen = sequence_scores(params, TINY_MODEL, pairs["chosen_BxS"], pairs["chosen_mask_BxS"])
    rejected = sequence_scores(params, TINY_MODEL, pairs["rejected_BxS"], pairs["rejected_mask_BxS"])
    assert float(loss) == pytest.approx(float(bradley_terry_loss(chosen, rejected)[0]), rel=1e-5)


def test_synthetic_pairs_follow_their_rule_on_disjoint_prompts():
    train, test = synthetic_pairs("arithmetic", 2, 300, 100, 0)
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    for p in train:
        a, b = map(int, p.prompt[:-1].split("+"))
        assert p.chosen == str(a + b) and p.rejected != p.chosen
    assert carry_dropped(58, 67) == 15 and carry_dropped(12, 34) == 46
    assert sum(p.rejected == str(carry_dropped(*map(int, p.prompt[:-1].split("+")))) for p in train) > 20
    longer = sum(len(p.rejected) > len(p.chosen) for p in train)
    shorter = sum(len(p.rejected) < len(p.chosen) for p in train)
    assert min(longer, shorter) > len(train) / 5  # length alone does not tell the right answer
    train, _ = synthetic_pairs("even_last", 2, 200, 10, 0)
    assert all(even_last_rule(p.chosen) and not even_last_rule(p.rejected) for p in train)


def test_pair_files_errors_name_the_file_and_line(tmp_path):
    good = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(good) + "\n")
    assert [p.where for p in read_pairs(path, 10)] == [f"{path}:1", f"{path}:3"]
    assert len(read_pairs(path, 1)) == 1
    for line, message in [
        ("{not json", "not a JSON object"),
        ("[1, 2]", "got a JSON list, expected an object"),
        ('{"prompt": "1+1=", "chosen": "2"}', "missing 'rejected'"),
        ('{"prompt": "1+1=", "chosen": 2, "rejected": "3"}', "'chosen' is a int, expected a string"),
    ]:
        path.write_text(json.dumps(good) + "\n" + line + "\n")
        with pytest.raises(ConfigError, match=f"reward_model.pairs_file: {path}:2: {message}"):
            read_pairs(path, 10)
    with pytest.raises(ConfigError, match="reward_model.pairs_file: file .*missing.jsonl' not found"):
        read_pairs(tmp_path / "missing.jsonl", 10)
    long = read_pairs(_write(tmp_path / "long.jsonl", {**good, "chosen": "1" * 20}), 10)
    with pytest.raises(ConfigError, match=r"long.jsonl:1: chosen: row 0 has 26 tokens.*model.max_seq_len=16"):
        tokenize_pairs(long, TOK, 16, "reward_model.pairs_file")
    odd = read_pairs(_write(tmp_path / "odd.jsonl", {**good, "rejected": "x"}), 10)
    with pytest.raises(ConfigError, match=r"odd.jsonl:1: rejected: character 'x' is not in the tokenizer"):
        tokenize_pairs(odd, TOK, 16, "reward_model.pairs_file")


def _write(path, obj):
    path.write_text(json.dumps(obj) + "\n")
    return path


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="reward_model.synthetic: got 'parity'"):
        apply_overrides(Config(), ["reward_model.synthetic=parity"]).validate()
    with pytest.raises(ConfigError, match="reward_model.test_file: got 'x.jsonl', expected '' unless"):
        apply_overrides(Config(), ["reward_model.test_file=x.jsonl"]).validate()
    with pytest.raises(ConfigError, match=r"loss.reward_weights: got \(1.0, 0.0\), expected None or 3 weights"):
        apply_overrides(Config(), ["reward_model.workdir=w", "loss.reward_weights=1,0"]).validate()
    assert load_config(REPO / "configs" / "grpo_rm_arith.py").loss.reward_weights == (0.0, 0.0, 1.0)


def _train(workdir, *extra):
    argv = ["reward-model", "train", str(REPO / "configs" / "rm_arith.py"), "--workdir", str(workdir)]
    return cli.main(argv + sum((["--set", s] for s in (*RM_TINY, *extra)), []))


def _rows(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_reward_model_learns_a_hidden_preference_resumes_exactly_and_scores_a_batch(tmp_path, capsys, monkeypatch):
    """40 steps of a 1-layer model: held-out pair accuracy >= 0.9 on a rule it never sees stated; 20 + 20
    steps in two runs of the command end with the same numbers as 40 in one."""
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    assert _train(whole, "reward_model.steps=40") == 0
    assert "held-out pair accuracy" in capsys.readouterr().err
    rows = _rows(whole)
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert rows[-1]["rm/test_accuracy"] >= 0.9
    assert _train(halves, "reward_model.steps=20") == 0
    assert _train(halves, "reward_model.steps=40") == 0  # resumes from step 20's checkpoint
    assert [r["step"] for r in _rows(halves)] == list(range(1, 41))
    for a, b in zip(rows, _rows(halves)):
        assert {k: v for k, v in a.items() if k != "rm/seconds"} == {k: v for k, v in b.items() if k != "rm/seconds"}

    # As a reward function: one forward over all rows == each row alone; a column after the verifier's.
    cfg = apply_overrides(Config(), [f"reward_model.workdir={whole}", "reward_model.score_batch=4"])
    scorer = load_scorer(cfg.reward_model)
    prompts, completions = ["1+2="] * 5 + ["40+41="], ["3", "4", "12", "7", "", "81"]
    batched = scorer(prompts, completions)
    alone = np.concatenate([scorer([p], [c]) for p, c in zip(prompts, completions)])
    np.testing.assert_allclose(batched, alone, rtol=1e-5, atol=1e-5)
    assert batched[1] > batched[0] and batched[2] > batched[3]  # the rule on pairs it never saw: even last wins
    whole_batch = RewardModelScorer(scorer.params, scorer.model_cfg, scorer.tokenizer, 0)
    assert _forward_shapes(whole_batch, prompts, completions, monkeypatch) == [(6, 16)]  # all rows, one forward
    assert _forward_shapes(scorer, prompts, completions, monkeypatch) == [(4, 16), (4, 16)]  # score_batch=4, padded
    verifier = RewardModelVerifier(verify_arithmetic, scorer)
    tokens_BxT = np.array([TOK.encode(c) + [TOK.eos_id, TOK.pad_id] for c in ["3", "4"]], np.int32)
    records = [{"prompt": "1+2=", "answer": "3"}] * 2
    rewards_BxK, n_failed = score_completions(
        tokens_BxT, np.array([True, True]), records, tokenizer=TOK, verifier=verifier
    )
    assert rewards_BxK.shape == (2, 3) and n_failed == 0
    np.testing.assert_array_equal(rewards_BxK[:, 0], [1.0, 0.0])
    np.testing.assert_allclose(rewards_BxK[:, 2], scorer(["1+2="] * 2, ["3", "4"]), rtol=1e-5)
    metrics = reward_metrics(rewards_BxK, np.ones((2, 3)), np.array([True, True]), 0, 0, (0.0, 0.0, 1.0))
    assert metrics["reward/reward_model"] == pytest.approx(float(rewards_BxK[:, 2].mean()))
    assert metrics["reward/mean"] == pytest.approx(metrics["reward/reward_model"])


def _forward_shapes(scorer, prompts, completions, monkeypatch) -> list:
    """The token shapes of the jitted forwards one scorer call runs."""
    shapes = []

    def counting(params, cfg, tokens_BxS, mask_BxS):
        shapes.append(tokens_BxS.shape)
        return sequence_scores(params, cfg, tokens_BxS, mask_BxS)

    monkeypatch.setattr(scorer_module, "sequence_scores", counting)
    scorer(prompts, completions)
    monkeypatch.undo()
    return shapes


def test_a_diverging_reward_model_stops_with_one_line(tmp_path, capsys):
    assert _train(tmp_path, "reward_model.steps=3", "reward_model.learning_rate=1e30") == 1
    assert "jaxrl: error: reward model: the loss is nan at step" in capsys.readouterr().err


def test_missing_reward_model_workdir_is_an_error_naming_the_field(tmp_path):
    cfg = apply_overrides(Config(), [f"reward_model.workdir={tmp_path}"])
    with pytest.raises(ConfigError, match="reward_model.workdir: .* has no reward_model.json"):
        load_scorer(cfg.reward_model)


# ---------------------------------------------------------------------------------------------
# Judges

YES_NO = Judge(template="{prompt}{completion}?", verdict=r"(YES|NO)", scores={"YES": 1.0, "NO": 0.0})


def test_verdict_parser_scores_parsed_and_unparsed():
    assert parse_verdict(YES_NO, "I say YES.") == 1.0
    assert parse_verdict(YES_NO, "NO, then YES") == 0.0  # the first verdict counts
    assert parse_verdict(YES_NO, "maybe") is None
    score = Judge(template="{prompt}{completion}", verdict=r"score: *(-?[0-9.]+)")
    assert parse_verdict(score, "score: 7") == 7.0 and parse_verdict(score, "score: 0.5") == 0.5
    assert parse_verdict(score, "score: .") is None and parse_verdict(score, "7") is None
    whole = Judge(template="{prompt}{completion}", verdict=r"[0-9]")  # no group: the whole match
    assert parse_verdict(whole, "ab3c9") == 3.0
    with pytest.raises(ConfigError, match=r"Judge.template: .* has no \{completion\}"):
        Judge(template="{prompt}", verdict="x")
    with pytest.raises(ConfigError, match="Judge.verdict: '\\(' is not a regular expression"):
        Judge(template="{prompt}{completion}", verdict="(")


def test_judge_batched_on_the_engine_equals_each_item_alone_and_counts_unparsed():
    """A random 1-layer judge: its greedy answers are junk, some holding a digit (the verdict) and some not."""
    params = init_params(dataclasses_replace(TINY_MODEL, max_seq_len=40), jax.random.key(3))
    cfg = dataclasses_replace(TINY_MODEL, max_seq_len=40)
    judge = Judge(template="{prompt}{completion}=", verdict=r"^([0-9])", prompt_len=16, max_new_tokens=6)
    prompts = ["1+2=", "33+4=", "5+5=", "7+80=", "9+9=", "12+3=", "4+4=", "60+6="]
    completions = ["3", "37", "11", "87", "18", "5", "8", "66"]
    batched = JudgeScorer.build(judge, cfg, params, TOK, rng=jax.random.key(0), slots=4, chunk=3)
    out = batched(prompts, completions)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        alone = JudgeScorer.build(judge, cfg, params, TOK, rng=jax.random.key(0), slots=4, chunk=3)([p], [c])
        assert (alone.texts, alone.reward_B[0]) == ([out.texts[i]], out.reward_B[i]), (i, out)
    assert batched.engine.counts["chunks"] < sum(len(t) for t in out.texts)  # decoded together, not in turn
    expected = [parse_verdict(judge, t) for t in out.texts]
    assert 0 < sum(v is None for v in expected) < len(prompts), out.texts  # both kinds present
    np.testing.assert_array_equal(out.parsed_B, [v is not None for v in expected])
    np.testing.assert_array_equal(out.reward_B, [0.0 if v is None else v for v in expected])
    metrics = judge_metrics(out)
    assert metrics["judge/unparsed_frac"] == pytest.approx(sum(v is None for v in expected) / len(prompts))
    # As a task's verifier: column 0 the judge's reward, column 1 whether it parsed.
    records = [{"prompt": p} for p in prompts]
    rewards_BxK, n_failed = JudgeVerifier(batched).score_batch(completions, [True] * 8, records)
    np.testing.assert_array_equal(rewards_BxK, np.stack([out.reward_B, out.parsed_B], 1).astype(np.float32))
    assert n_failed == sum(v is None for v in expected)  # a run's reward/failed


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


# ---------------------------------------------------------------------------------------------
# RL against a reward model

EVEN_TASK = '''
import numpy as np

from jaxrl.config import Config, DataConfig, LossConfig, RolloutConfig
from jaxrl.data.registry import Task, register_task
from jaxrl.rewards.pairs import even_last_rule


def records(split, n, seed):
    """'a+b=' prompts whose demonstrations are 1-2 random digits, 4 in 5 ending in an odd digit: the
    warm-started policy mostly breaks the rule the reward model learned."""
    rng = np.random.default_rng([seed, split == "test"])
    first = 0 if split == "train" else 5000
    odd = rng.random(n) < 0.8
    last = np.where(odd, rng.choice([1, 3, 5, 7, 9], n), rng.choice([0, 2, 4, 6, 8], n))
    answers = [str(int(d)) + str(int(x)) if d else str(int(x)) for d, x in zip(rng.integers(0, 10, n), last)]
    return [{"id": f"{split}/{i}", "prompt": f"{(first + i) // 100 % 100}+{(first + i) % 100}=",
             "answer": answers[i]} for i in range(n)]


def verify(completion, finished, record):
    """Correctness: the reward model's hidden preference (eval/accuracy measures it, the loss ignores it)."""
    return float(even_last_rule(completion)), float(finished)


register_task(Task("rm_even_last", records=records, verifier=verify))


def get_config():
    return Config(data=DataConfig(task="rm_even_last", max_prompt_len=8), rollout=RolloutConfig(max_new_tokens=4),
                  loss=LossConfig(preset="grpo", kl_beta=0.0, reward_weights=(0.0, 0.0, 1.0)))
'''
RL_TINY = [
    *("model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16"),
    *("model.mlp_dim=64", "data.num_train=600", "data.num_test=60", "rollout.prompts_per_step=4"),
    *("rollout.group_size=8", "warmstart.steps=100", "warmstart.batch_size=16", "train.eval_prompts=60"),
    *("train.eval_every=8", "train.steps=16", "train.progress=false", "optim.learning_rate=1e-3"),
    "optim.warmup_steps=0",
]


@pytest.mark.slow
def test_rl_against_the_reward_model_improves_the_held_out_preference(tmp_path, in_process_cache):
    """GRPO whose only reward is a tiny reward model of the even_last rule: the greedy held-out rate of
    completions that follow the rule (the task's correctness, logged, not rewarded) rises from the warm
    start's (0.0) to at least 0.5 in 16 steps (measured: 0.0 -> 1.0)."""
    assert _train(tmp_path / "rm", "reward_model.steps=40") == 0
    config = tmp_path / "even_task.py"
    config.write_text(EVEN_TASK)
    argv = ["train", str(config), "--workdir", str(tmp_path / "rl"), "--set", f"reward_model.workdir={tmp_path / 'rm'}"]
    assert cli.main(argv + sum((["--set", s] for s in RL_TINY), [])) == 0
    rows = _rows(tmp_path / "rl")
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    assert len(evals) == 3 and evals[-1] >= evals[0] + 0.5, evals
    trained = [r for r in rows if "reward/reward_model" in r]
    assert len(trained) == 16 and all(r["reward/mean"] == pytest.approx(r["reward/reward_model"]) for r in trained)


JUDGE_TASK = """
import jax

from jaxrl.config import Config, DataConfig, LossConfig, ModelConfig, RolloutConfig
from jaxrl.data.registry import Task, register_task
from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.models.transformer import init_params
from jaxrl.rewards.judge import Judge, JudgeScorer, JudgeVerifier

TOK = CharTokenizer()
JUDGE_MODEL = ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
                          max_seq_len=40, vocab_size=TOK.vocab_size)
# A random judge: its greedy verdict is junk, a leading digit read as the reward (else unparsed).
JUDGE = JudgeScorer.build(Judge(template="{prompt}{completion}=", verdict=r"^([0-9])", prompt_len=16,
                                max_new_tokens=4), JUDGE_MODEL, init_params(JUDGE_MODEL, jax.random.key(3)), TOK,
                          rng=jax.random.key(0), slots=8, chunk=4)


def records(split, n, seed):
    first = 0 if split == "train" else 5000
    a = [(first + i) % 100 for i in range(n)]
    return [{"id": f"{split}/{i}", "prompt": f"{a[i]}+{i % 10}=", "answer": str(a[i] + i % 10)} for i in range(n)]


register_task(Task("judged_sums", records=records, verifier=JudgeVerifier(JUDGE)))


def get_config():
    return Config(data=DataConfig(task="judged_sums", max_prompt_len=8), rollout=RolloutConfig(max_new_tokens=4),
                  loss=LossConfig(preset="grpo", kl_beta=0.0, reward_weights=(1.0, 0.0)))
"""


@pytest.mark.slow
def test_a_judge_as_the_tasks_verifier_trains_and_counts_its_unparsed_verdicts(tmp_path, in_process_cache):
    config = tmp_path / "judged.py"
    config.write_text(JUDGE_TASK)
    tiny = [s for s in RL_TINY if not s.startswith(("train.steps", "train.eval_every", "warmstart.steps"))]
    overrides = [*tiny, "train.steps=2", "train.eval_every=2", "warmstart.steps=10"]
    argv = ["train", str(config), "--workdir", str(tmp_path / "rl")] + sum((["--set", s] for s in overrides), [])
    assert cli.main(argv) == 0
    trained = [r for r in _rows(tmp_path / "rl") if "reward/failed" in r]
    assert len(trained) == 2
    for r in trained:  # 32 rows a step: the unparsed ones are reward/failed, the parsed share reward/format
        assert r["reward/failed"] == pytest.approx(32 * (1 - r["reward/format"]))
    assert any(r["reward/failed"] > 0 for r in trained) and any(r["reward/format"] > 0 for r in trained)


def _judge_checkpoint(directory):
    """A random 1-layer judge saved as `jaxrl convert --from-hf` writes one: params, model_config.json,
    and the character tokenizer as Hugging Face tokenizer files."""
    import dataclasses

    import orbax.checkpoint as ocp

    from jaxrl.data.hf_tokenizer import save_char_tokenizer
    from jaxrl.policy.resolve import MODEL_CONFIG

    cfg = dataclasses.replace(TINY_MODEL, max_seq_len=40)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((directory / "params").absolute(), init_params(cfg, jax.random.key(3)))
    checkpointer.wait_until_finished()
    (directory / MODEL_CONFIG).write_text(json.dumps(dataclasses.asdict(cfg)))
    save_char_tokenizer(TOK, directory, cfg.max_seq_len)
    return directory


@pytest.mark.slow
def test_a_judge_configured_by_reward_model_fields_scores_a_run(tmp_path, in_process_cache):
    judge_dir = _judge_checkpoint(tmp_path / "judge")
    judge = [
        f"reward_model.judge_path={judge_dir}",
        *("reward_model.judge_template={prompt}{completion}=", "reward_model.judge_verdict=^([0-9])"),
        *("reward_model.judge_prompt_len=16", "reward_model.judge_max_new_tokens=4", "reward_model.judge_slots=8"),
    ]
    tiny = [s for s in RL_TINY if not s.startswith(("train.steps", "train.eval_every", "warmstart.steps"))]
    overrides = [*tiny, "train.steps=2", "train.eval_every=2", "warmstart.steps=10", *judge]
    argv = ["train", str(REPO / "configs" / "grpo_arithmetic.py"), "--workdir", str(tmp_path / "rl")]
    assert cli.main(argv + sum((["--set", s] for s in overrides), [])) == 0
    trained = [r for r in _rows(tmp_path / "rl") if "reward/failed" in r]
    assert len(trained) == 2
    for r in trained:  # the judge's verdicts, not the sums' correctness: unparsed ones are reward/failed
        assert r["reward/failed"] == pytest.approx(32 * (1 - r["reward/format"]))
    assert any(r["reward/failed"] > 0 for r in trained) and any(r["reward/format"] > 0 for r in trained)
    assert any(r["reward/correctness"] > 1 for r in trained)  # a digit read as the reward: not a 0/1 verifier


def test_judge_fields_errors_name_the_field():
    for setting, message in [
        ("reward_model.judge_template={prompt}", r"reward_model.judge_template: .* containing \{completion\}"),
        ("reward_model.judge_verdict=(", r"reward_model.judge_verdict: got '\(', expected a regular expression"),
        ("reward_model.judge_scores=YES", r"reward_model.judge_scores: got 'YES', expected '' or 'VERDICT=number"),
        ("reward_model.judge_slots=0", "reward_model.judge_slots: got 0, expected a positive integer"),
    ]:
        with pytest.raises(ConfigError, match=message):
            apply_overrides(Config(), [setting]).validate()
    from jaxrl.config.reward_model import judge_scores
    from jaxrl.rewards.judge import load_judge

    assert judge_scores("YES=1,NO=0") == {"YES": 1.0, "NO": 0.0} and judge_scores("") is None
    with pytest.raises(ConfigError, match="reward_model.judge_path: directory '/nowhere' not found"):
        load_judge(apply_overrides(Config(), ["reward_model.judge_path=/nowhere"]).reward_model, 0)
