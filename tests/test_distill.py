"""On-policy distillation: the reverse-KL advantage by hand, the teacher's forward on the student's own
samples (another architecture, a jaxrl run or a Hugging Face checkpoint), tokenizer mismatches, and a
2-step `jaxrl train` with the `distill` preset whose checkpoints never hold the teacher."""

import dataclasses
import json
import shutil
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import DEFAULT_CONFIG, REPO, TINY
from preset_configs import check_config_trains_two_steps, config_path, overrides

from jaxrl.config import Config, ConfigError, DistillConfig, LossConfig, ModelConfig, load_config
from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.losses import PRESETS, evaluate_loss, make_loss, prepare_batch
from jaxrl.losses.distill import reads_teacher
from jaxrl.models.transformer import init_params, token_logprobs
from jaxrl.rollout.sampler import SamplingParams, sample
from jaxrl.sharding import make_mesh
from jaxrl.train import loop
from jaxrl.train import teacher as teacher_lib

B, T, G = 6, 5, 3
ALPHABET = "0123456789+=-*/ "
STUDENT = ModelConfig(
    vocab_size=len(ALPHABET) + 3,
    d_model=32,
    n_layers=1,
    n_heads=2,
    n_kv_heads=1,
    head_dim=16,
    mlp_dim=64,
    max_seq_len=16,
)
# Another architecture with the same tokenizer: deeper, wider, more heads.
TEACHER = dataclasses.replace(STUDENT, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, mlp_dim=96)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.array([5, 3, 1, 0, 4, 2])  # row 3: a padding row
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    rollout = np.where(mask > 0, -2.0 * rng.random((B, T)), 0.0).astype(np.float32)
    return {
        "completion_mask_BxT": mask,
        "rewards_BxK": np.array([[1, 0], [0, 0], [0, 0], [1, 0], [1, 0], [0, 0]], np.float32),
        "truncated_B": np.zeros(B, np.float32),
        "rollout_logp_BxT": rollout,
        "teacher_logp_BxT": np.where(mask > 0, -2.0 * rng.random((B, T)), 0.0).astype(np.float32),
    }


def test_the_advantage_is_minus_the_per_token_reverse_kl_plus_the_weighted_task_advantage():
    batch = _batch()
    live = batch["completion_mask_BxT"] > 0
    kl = np.where(live, batch["rollout_logp_BxT"] - batch["teacher_logp_BxT"], 0.0)
    # GRPO's task advantage by hand: groups of 3, unbiased std. Rows 0-2: rewards 1,0,0 -> A = (r - 1/3) / std.
    r = batch["rewards_BxK"][:, 0]
    task = np.zeros(B, np.float32)
    for g in range(B // G):
        x = r[g * G : (g + 1) * G]
        task[g * G : (g + 1) * G] = (x - x.mean()) / (x.std(ddof=1) + 1e-6) if x.std() > 0 else 0.0
    for w in (0.0, 0.5):
        out = prepare_batch(PRESETS["distill"](reward_weight=w), batch, group_size=G, max_new_tokens=T)
        want = np.where(live, -kl + w * task[:, None], 0.0)
        np.testing.assert_allclose(np.asarray(out["advantages_BxT"]), want, rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(out["advantages_BxT"])[3] == 0)  # the padding row
    # The metrics: token means over the live tokens.
    logp = jnp.asarray(batch["rollout_logp_BxT"])
    metrics = evaluate_loss(PRESETS["distill"](), logp, dict(batch, old_logp_BxT=logp), group_size=G, max_new_tokens=T)
    m = metrics.metrics
    assert float(m["distill/reverse_kl"]) == pytest.approx(kl[live].mean(), rel=1e-5)
    assert float(m["distill/teacher_logp"]) == pytest.approx(batch["teacher_logp_BxT"][live].mean(), rel=1e-5)
    assert float(m["distill/advantage"]) == pytest.approx(-kl[live].mean(), rel=1e-5)
    # With the ratio at 1 the gradient of the token-mean loss is -A_t / N on every live token.
    grad = jax.grad(
        lambda lp: (
            evaluate_loss(PRESETS["distill"](), lp, dict(batch, old_logp_BxT=logp), group_size=G, max_new_tokens=T).loss
        )
    )(logp)
    np.testing.assert_allclose(np.asarray(grad), np.where(live, kl / live.sum(), 0.0), rtol=1e-5, atol=1e-7)


def test_a_teacher_equal_to_the_student_gives_zero_advantage_and_zero_gradient():
    batch = _batch()
    batch["teacher_logp_BxT"] = batch["rollout_logp_BxT"].copy()
    logp = jnp.asarray(batch["rollout_logp_BxT"])
    loss = PRESETS["distill"]()
    out = prepare_batch(loss, batch, group_size=G, max_new_tokens=T)
    assert np.all(np.asarray(out["advantages_BxT"]) == 0.0)
    grad = jax.grad(
        lambda lp: evaluate_loss(loss, lp, dict(batch, old_logp_BxT=logp), group_size=G, max_new_tokens=T).loss
    )(logp)
    assert np.all(np.asarray(grad) == 0.0)


def test_a_batch_without_teacher_scores_is_an_error_naming_the_field():
    batch = _batch()
    del batch["teacher_logp_BxT"]
    with pytest.raises(KeyError, match="teacher_logp_BxT.*distill.teacher"):
        prepare_batch(PRESETS["distill"](), batch, group_size=G, max_new_tokens=T)


def test_reward_weight_is_a_preset_parameter_and_only_distill_reads_the_teacher():
    assert reads_teacher(make_loss(LossConfig(preset="distill", options={"reward_weight": 0.25})))
    assert not reads_teacher(make_loss(LossConfig(preset="grpo")))
    with pytest.raises(ConfigError, match="reward_weight"):
        make_loss(LossConfig(preset="distill", options={"reward_weight": -1.0}))


def _sampled(params, cfg, seed=0):
    """Prompts and the student's own samples: (batch of the update's fields, rollout log-probs)."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(3, cfg.vocab_size, (2, 4)).astype(np.int32)
    prompt_mask = np.ones_like(prompts, bool)
    prompt_mask[1, 0] = False  # a left-padded prompt
    prompts[1, 0] = 0
    out = sample(
        params,
        cfg,
        prompts,
        prompt_mask,
        jax.random.key(seed),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=T, eos_id=2, pad_id=0),
        group_size=G,
    )
    return {
        "prompt_tokens_BxP": np.repeat(prompts, G, 0),
        "prompt_mask_BxP": np.repeat(prompt_mask, G, 0),
        "tokens_BxT": np.asarray(out.tokens_BxT),
        "completion_mask_BxT": np.asarray(out.completion_mask_BxT),
    }, np.asarray(out.logp_BxT)


@pytest.mark.parametrize("microbatches", [0, 2])
def test_the_teacher_forward_on_the_students_samples_is_the_teachers_token_logprobs(microbatches):
    student = init_params(STUDENT, jax.random.key(0))
    teacher = init_params(TEACHER, jax.random.key(1))
    batch, rollout_logp = _sampled(student, STUDENT)
    cfg = Config(
        rollout=dataclasses.replace(Config().rollout, group_size=G, prompts_per_step=2, max_new_tokens=T),
        train=dataclasses.replace(Config().train, microbatches=microbatches),
    )
    got = jax.jit(teacher_lib.teacher_logp_fn(cfg, TEACHER))(teacher, batch)
    want, _ = token_logprobs(teacher, TEACHER, *(batch[k] for k in teacher_lib.FORWARD_KEYS), cfg.rollout.temperature)
    live = batch["completion_mask_BxT"] > 0
    np.testing.assert_allclose(np.asarray(got), np.where(live, want, 0.0), rtol=1e-5, atol=1e-5)
    # The student scoring its own samples: the sampler's log-probs again (to float summation order),
    # so a teacher equal to the student gives an advantage of ~0 on the exact tokens drawn.
    own = jax.jit(teacher_lib.teacher_logp_fn(cfg, STUDENT))(student, batch)
    np.testing.assert_allclose(np.asarray(own), rollout_logp, atol=2e-5)
    assert np.abs(np.asarray(got) - rollout_logp)[live].mean() > 0.1  # another model: another score


def _write_hf(directory, params, cfg, tokenizer):
    from jaxrl.policy.convert import _save_hf

    _save_hf(directory, jax.tree.map(np.asarray, params), cfg, tokenizer, "float32", 0)


def test_the_update_step_follows_the_teachers_advantage_not_the_reward():
    """The jitted update (steps.make_update_step), on the student's own samples with rewards that differ
    within each group: with the teacher equal to the sampler the distill gradient is exactly 0 (GRPO's
    is not); with another teacher it is the gradient of -A_t logp, A_t the reverse KL advantage."""
    from jaxrl.config import OptimConfig
    from jaxrl.train.state import init_state, make_optimizer
    from jaxrl.train.steps import make_logp_fn, make_update_step

    params = init_params(STUDENT, jax.random.key(0))
    batch, rollout_logp = _sampled(params, STUDENT)
    rewards = np.zeros((B, 2), np.float32)
    rewards[::2, 0] = 1.0  # rows 0, 2, 4 right: no group is constant
    batch = dict(batch, rollout_logp_BxT=rollout_logp, rewards_BxK=rewards, truncated_B=np.zeros(B, np.float32))
    logp_fn = make_logp_fn(STUDENT, 1.0)
    optimizer = make_optimizer(OptimConfig(learning_rate=1e-3, warmup_steps=0), total_steps=4)

    def grad_norm(preset: str, teacher_logp_BxT) -> float:
        step = make_update_step(
            logp_fn, PRESETS[preset](), optimizer, ppo_epochs=1, microbatches=1, max_new_tokens=T, group_size=G
        )
        state = init_state(params, optimizer, jax.random.key(0))
        _, metrics = jax.jit(step)(state, dict(batch, teacher_logp_BxT=teacher_logp_BxT))
        return float(metrics["grad_norm"])

    assert grad_norm("distill", rollout_logp) == 0.0
    assert grad_norm("grpo", rollout_logp) > 0.0
    assert grad_norm("distill", rollout_logp - 1.0) > 0.0  # a teacher that gives every sampled token less probability


def _tokenizers_differ(student, teacher, match):
    with pytest.raises(ConfigError, match=match):
        teacher_lib.check_same_tokenizer(student, teacher)


def test_a_teacher_with_another_tokenizer_is_an_error_naming_distill_teacher():
    teacher_lib.check_same_tokenizer(CharTokenizer(ALPHABET), CharTokenizer(ALPHABET))
    _tokenizers_differ(CharTokenizer(ALPHABET), CharTokenizer(ALPHABET + "x"), "distill.teacher.*vocab_size=20.*19")
    # Same size, one id spelled differently.
    _tokenizers_differ(CharTokenizer(ALPHABET), CharTokenizer(ALPHABET[:-1] + "x"), "distill.teacher: token id 18")


@pytest.fixture(scope="module")
def hf_teacher(tmp_path_factory):
    """A Hugging Face checkpoint of TEACHER's architecture with the student's character tokenizer."""
    pytest.importorskip("tokenizers")
    directory = tmp_path_factory.mktemp("hf") / "teacher"
    _write_hf(directory, init_params(TEACHER, jax.random.key(1)), TEACHER, CharTokenizer(ALPHABET))
    return directory


def _hf_config(directory, **loss):
    return Config(
        model=STUDENT,
        rollout=dataclasses.replace(Config().rollout, group_size=G, prompts_per_step=2, max_new_tokens=T),
        loss=LossConfig(**loss),
        distill=DistillConfig(teacher=str(directory)),
    )


def test_a_hugging_face_teacher_of_another_architecture_scores_like_its_params(hf_teacher, tmp_path):
    tok = CharTokenizer(ALPHABET)
    teacher = init_params(TEACHER, jax.random.key(1))
    cfg = _hf_config(hf_teacher)
    mesh, preset = make_mesh(cfg.mesh)
    loaded = teacher_lib.load_teacher(cfg, tok, mesh, preset)
    assert (loaded.model_cfg.n_layers, loaded.model_cfg.d_model) == (2, 48)
    batch, _ = _sampled(init_params(STUDENT, jax.random.key(0)), STUDENT)
    scored = teacher_lib.teacher_scorer(cfg, loaded, mesh, preset)({k: jnp.asarray(v) for k, v in batch.items()})
    want = jax.jit(teacher_lib.teacher_logp_fn(cfg, TEACHER))(teacher, batch)
    np.testing.assert_allclose(np.asarray(scored["teacher_logp_BxT"]), np.asarray(want), rtol=1e-5, atol=1e-5)
    # Another vocabulary: the checkpoint's tokenizer.json disagrees with the student's.
    _write_hf(
        tmp_path / "other",
        init_params(dataclasses.replace(TEACHER, vocab_size=20), jax.random.key(2)),
        dataclasses.replace(TEACHER, vocab_size=20),
        CharTokenizer(ALPHABET + "x"),
    )
    other = dataclasses.replace(cfg, distill=DistillConfig(teacher=str(tmp_path / "other")))
    with pytest.raises(ConfigError, match="distill.teacher.*vocab_size"):
        teacher_lib.load_teacher(other, tok, mesh, preset)


# --- `jaxrl train` with the preset: a tiny teacher run (other depth and width), then 2 distillation steps.

OVERRIDES = [t for t in TINY if not t.startswith("train.eval_")] + ["train.eval_every=0", "train.eval_prompts=4"]


def test_check_teacher_names_the_field_and_the_command_that_makes_the_teacher(tmp_path):
    distill = make_loss(LossConfig(preset="distill"))
    with pytest.raises(ConfigError, match="distill.teacher: empty, but loss 'distill'"):
        teacher_lib.check_teacher(load_config(DEFAULT_CONFIG, OVERRIDES), distill)
    cfg = load_config(
        DEFAULT_CONFIG,
        OVERRIDES + [f"distill.teacher={tmp_path / 'nope'}", "distill.teacher_command=jaxrl train t.py --workdir nope"],
    )
    with pytest.raises(
        ConfigError, match=r"does not exist; make it with \(distill.teacher_command\): jaxrl train t.py --workdir nope"
    ):
        teacher_lib.check_teacher(cfg, distill)
    with pytest.raises(ConfigError, match="distill.teacher: set to .*reads no teacher"):
        teacher_lib.check_teacher(cfg, make_loss(LossConfig(preset="grpo")))
    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
    cfg = load_config(DEFAULT_CONFIG, OVERRIDES + [f"distill.teacher={tmp_path / 'empty_run'}"])
    with pytest.raises(ConfigError, match="distill.teacher: .* is neither a jaxrl run directory"):
        teacher_lib.check_teacher(cfg, distill)
    (tmp_path / "empty_run" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="distill.teacher .*no finished checkpoint"):
        teacher_lib.check_teacher(cfg, distill)
    with pytest.raises(ConfigError, match="distill.teacher_command"):
        load_config(DEFAULT_CONFIG, OVERRIDES + ["distill.teacher_command=make it"])


@pytest.mark.slow
def test_the_shipped_config_trains_two_steps_from_a_teacher_run_never_saved_with_the_student(
    tmp_path, in_process_cache
):
    """configs/distill_teacher.py (tiny, 2 layers of width 48) makes the teacher run; the shipped
    configs/distill_arithmetic.py (tiny, 1 layer of width 32) trains 2 steps against it
    (preset_configs.check_config_trains_two_steps, as every preset's config)."""
    teacher_cfg = load_config(
        REPO / "configs" / "distill_teacher.py",
        OVERRIDES + ["train.steps=1", "model.n_layers=2", "model.d_model=48", "model.head_dim=24"],
    )
    loop.train(teacher_cfg, tmp_path / "teacher")
    extra = (f"distill.teacher={tmp_path / 'teacher'}", "checkpoint.every=1")
    check_config_trains_two_steps("distill", tmp_path / "student", extra)
    rows = [json.loads(line) for line in (tmp_path / "student" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 2
    for row in steps:
        assert np.isfinite(row["distill/reverse_kl"]) and row["distill/reverse_kl"] != 0
        assert row["distill/teacher_logp"] < 0
        assert row["distill/advantage"] == pytest.approx(-row["distill/reverse_kl"], rel=1e-5)
        assert row["grad_norm"] > 0
    # The checkpoint is the student's state alone: its params have the student's shapes, no teacher copy.
    meta = ocp.StandardCheckpointHandler().metadata(tmp_path / "student" / "checkpoints" / "2" / "state")
    assert (
        set(cast(dict, meta)) <= {"step", "params", "opt_state", "rng", "ref_params"} and meta.get("ref_params") is None
    )
    assert meta["params"]["embedding"].shape[-1] == 32  # TINY's d_model, not the teacher's 48
    saved = json.loads((tmp_path / "student" / "config.json").read_text())
    assert saved["distill"]["teacher"] == str(tmp_path / "teacher")
    # Resumed from step 1 (the teacher reloaded from its run, not from the student's checkpoint), step 2
    # is the uninterrupted run's bit for bit.
    shutil.copytree(tmp_path / "student", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "2")
    resumed = loop.train(load_config(config_path("distill"), [*overrides("distill"), *extra]), tmp_path / "resumed")
    timing = ("step_seconds", "wall_time", "rollout/seconds", "rollout/tokens_per_s")
    assert [r["step"] for r in resumed] == [0, 1, 2]  # the rows before the resume point are kept
    assert {k: v for k, v in resumed[2].items() if k not in timing} == {
        k: v for k, v in steps[1].items() if k not in timing
    }


def test_the_teacher_forward_is_its_own_program_outside_the_update(hf_teacher):
    """`jaxrl plan` compiles the teacher's forward as a program of its own, and the distill update's
    FLOPs stay the student's: no teacher forward inside the update (or its epochs loop)."""
    from jaxrl.train.plan import plan

    def flops(cfg, program):
        (record,) = plan(cfg, (program,))
        return record["flops_per_device"]

    distill = _hf_config(hf_teacher, preset="distill")
    grpo = dataclasses.replace(distill, loss=LossConfig(preset="grpo"), distill=DistillConfig())
    teacher, update = flops(distill, "teacher"), flops(distill, "update")
    assert update == pytest.approx(flops(grpo, "update"), rel=0.02)  # the loss's few elementwise ops differ
    # A program of the teacher's size: its forward (2 layers of width 48; XLA's cost analysis counts the
    # scanned layer stack's body once, in both programs) against the student's forward + backward.
    assert teacher > 0.3 * update
    with pytest.raises(ConfigError, match="--programs teacher: the config has no distill.teacher"):
        plan(grpo, ("teacher",))
