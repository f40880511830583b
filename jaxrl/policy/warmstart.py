"""The base policy: a short supervised warm start on the task, cached on disk.

Post-training needs a policy that already answers in the right format and sometimes correctly. A few
hundred steps of next-token training on reference answers make one; it is kept deliberately short so
RL has room to improve. The result is cached under a key of everything that determines it, so
`make train` builds it once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

from jaxrl.agents.warmstart import demonstrated, suite_fingerprint, teacher_batch
from jaxrl.config import Config, ConfigError, DataConfig, ModelConfig, WarmStartConfig
from jaxrl.data.registry import Task, get_task
from jaxrl.data.stream import StreamState, next_batch
from jaxrl.data.tasks import RecordSource
from jaxrl.models.transformer import abstract_params, init_params, token_logprobs
from jaxrl.sources.prompts import completion_targets, next_prompts

# The ModelConfig fields that existed before MoE: dense cache keys are computed from these only.
_DENSE_MODEL_FIELDS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "mlp_dim",
    "rope_theta",
    "norm_eps",
    "tie_embeddings",
    "max_seq_len",
    "dtype",
)


def _without_new_defaults(section, default) -> dict:
    """asdict(section) minus the Hugging Face interop fields that hold their default, so a cache key
    depends on them only when they are set."""
    later = (
        "qkv_bias",
        "qk_norm",
        "attention",
        "decode_attention",
        "decode_block",
        "rope_scaling",
        "rope_scaling_factor",
        "rope_low_freq_factor",
        "rope_high_freq_factor",
        "rope_original_max_len",
        "router_norm_topk",
        "shared_expert_gate",
        "hf_path",
        "dense_tail_layers",
        "hf_max_position_embeddings",
        "train_file",
        "test_file",
        "prompt_template",
        "source",
        "checkpoint",
    )
    return {k: v for k, v in dataclasses.asdict(section).items() if k not in later or v != getattr(default, k)}


def cache_root(cfg: Config) -> pathlib.Path:
    root = cfg.warmstart.cache_dir or os.environ.get("JAXRL_CACHE_DIR") or "~/.cache/jaxrl/warmstart"
    return pathlib.Path(root).expanduser()


def warmstart_seed(cfg: Config) -> int:
    """The seed of the warm start: warmstart.seed, or train.seed when it is -1."""
    return cfg.train.seed if cfg.warmstart.seed < 0 else cfg.warmstart.seed


def cache_key(cfg: Config, model_cfg: ModelConfig, vocab: str) -> str:
    model = _without_new_defaults(model_cfg, ModelConfig())
    model.pop("lora", None)  # adapters train on top of the base: a LoRA run shares the full run's base
    if not model_cfg.n_experts:  # a dense model's key must not change when MoE fields are added
        model = {k: v for k, v in model.items() if k in _DENSE_MODEL_FIELDS}
    what = {
        "model": model,
        "data": {k: v for k, v in _without_new_defaults(cfg.data, DataConfig()).items() if k != "data_dir"},
        "warmstart": {
            k: v
            for k, v in _without_new_defaults(cfg.warmstart, WarmStartConfig()).items()
            if k not in ("cache_dir", "seed")
        },
        "answer_width": cfg.rollout.max_new_tokens,
        "seed": warmstart_seed(cfg),
        "vocab": vocab,
        "version": 1,
    }
    task = get_task(cfg.data.task)
    if task.episodic:  # the demonstrations come from the suite's environment and teacher
        what["agent_suite"] = suite_fingerprint(task.suite)
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def check_warm_start(cfg: Config, task: Task) -> None:
    """What the warm start of `task` can be made from (one-line errors naming warmstart.source)."""
    ws, source = cfg.warmstart, cfg.warmstart.source
    if cfg.model.hf_path or ws.steps == 0 or source == "none":
        return  # a checkpoint's weights, or the randomly initialised model: nothing to imitate
    if not task.episodic:
        if source == "demonstrations":
            raise ConfigError(
                f"warmstart.source: got 'demonstrations', but {task.name!r} is a text task whose demonstrations "
                "are its records' answers; expected 'teacher' or 'none'"
            )
        if ws.teacher_error > 0 and task.teacher is None:
            raise ConfigError(
                f"warmstart.teacher_error: got {ws.teacher_error}, but task {task.name!r} has no fallible "
                "teacher (Task.teacher); expected 0"
            )
        return
    suite = task.suite
    if source == "teacher" and suite.teacher is None:
        raise ConfigError(
            f"warmstart.source: got 'teacher', but environment {task.name!r} has no teacher; expected "
            "'demonstrations' (EnvSuite.demonstrations) or 'none', or a checkpoint in model.hf_path"
        )
    if source == "demonstrations" and not suite.demonstrations:
        raise ConfigError(
            f"warmstart.source: got 'demonstrations', but environment {task.name!r} gives none "
            "(EnvSuite.demonstrations); expected 'teacher' or 'none', or a checkpoint in model.hf_path"
        )


def sft_loss(logp_BxT, mask_BxT):
    """Mean negative log-likelihood over the masked-in tokens; a masked-out token (an observation of a
    multi-turn episode, padding) gets exactly zero gradient."""
    return -jnp.sum(jnp.where(mask_BxT > 0, logp_BxT, 0.0)) / jnp.maximum(jnp.sum(mask_BxT), 1.0)


def make_sft_step(model_cfg: ModelConfig, optimizer: optax.GradientTransformation):
    def loss_fn(params, batch):
        logp_BxT, _ = token_logprobs(
            params,
            model_cfg,
            batch["prompt_tokens_BxP"],
            batch["prompt_mask_BxP"],
            batch["tokens_BxT"],
            batch["completion_mask_BxT"],
            1.0,
        )
        return sft_loss(logp_BxT, batch["completion_mask_BxT"])

    @jax.jit
    def sft_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return sft_step


def train_base(cfg: Config, model_cfg: ModelConfig, tokenizer, train_source, progress: bool = True):
    """Supervised next-token training on the reference answers of the train split (on the suite's
    teacher episodes or given demonstrations for an environment: jaxrl.agents.warmstart); no step with
    warmstart.source='none'."""
    ws, task = cfg.warmstart, get_task(cfg.data.task)
    check_warm_start(cfg, task)
    rng = jax.random.key(warmstart_seed(cfg))
    params = init_params(model_cfg, jax.random.fold_in(rng, 1))
    optimizer = optax.adam(
        optax.warmup_cosine_decay_schedule(
            0.0, ws.learning_rate, min(20, ws.steps), max(ws.steps, 21), ws.learning_rate * 0.1
        )
    )
    opt_state = optimizer.init(params)
    sft_step = make_sft_step(model_cfg, optimizer)
    stream = StreamState(0, 0)
    teacher_rng = np.random.default_rng(warmstart_seed(cfg) + 104729)
    bar = tqdm(range(0 if ws.source == "none" else ws.steps), desc="warm start", disable=not progress, leave=False)
    suite = task.suite if task.episodic else None
    if suite is not None and ws.source == "demonstrations":
        suite, records = demonstrated(suite)
        train_source = RecordSource(f"{suite.name}/demonstrations", records)
    for _ in bar:
        if suite is not None:
            records, stream = next_batch(train_source, stream, ws.batch_size, cfg.data.seed + 7919)
            batch, _ = teacher_batch(
                suite,
                records,
                tokenizer,
                cfg.data.max_prompt_len,
                cfg.rollout.max_new_tokens,
                ws.teacher_error,
                teacher_rng,
            )
        else:
            batch, stream = _answer_batch(cfg, task, tokenizer, train_source, stream, teacher_rng)
        params, opt_state, loss = sft_step(params, opt_state, batch)
        bar.set_postfix(loss=f"{float(loss):.3f}")
    return params


def _answer_batch(
    cfg: Config, task: Task, tokenizer, train_source, stream: StreamState, teacher_rng: np.random.Generator
):
    """The next SFT batch of single-turn reference answers (the task's fallible teacher's with
    warmstart.teacher_error)."""
    records, prompt_BxP, pmask_BxP, stream, _ = next_prompts(
        train_source, stream, cfg.warmstart.batch_size, tokenizer, cfg.data, cfg.data.seed + 7919
    )
    fallible = teacher_rng.random(len(records)) < cfg.warmstart.teacher_error
    for record in records:
        if "answer" not in record:
            raise ConfigError(
                f"warmstart.source: record {record['id']!r} of task {task.name!r} has no 'answer' to imitate; "
                "give the records answers, or set warmstart.source='none'"
            )
    answers = [task.teacher(r) if f and task.teacher else r["answer"] for r, f in zip(records, fallible)]
    tok_BxT, mask_BxT = completion_targets(tokenizer, answers, cfg.rollout.max_new_tokens, [r["id"] for r in records])
    batch = {
        "prompt_tokens_BxP": prompt_BxP,
        "prompt_mask_BxP": pmask_BxP,
        "tokens_BxT": tok_BxT,
        "completion_mask_BxT": mask_BxT,
    }
    return batch, stream


def load_or_train_base(
    cfg: Config, model_cfg: ModelConfig, tokenizer, train_source, vocab: str, progress: bool = True, shardings=None
):
    """The cached base policy for this config, trained first if missing. Returns (params, path).

    With `shardings` (a pytree of NamedShardings), a cached policy is restored straight into that
    layout. With several processes, each restores its share collectively; a missing cache entry is
    trained by every process alike (deterministic) and not written, so no two processes race on it.
    """
    path = cache_root(cfg) / cache_key(cfg, model_cfg, vocab)
    abstract = abstract_params(model_cfg, shardings)
    ckptr = ocp.StandardCheckpointer()
    cached = (path / "params").exists()
    if jax.process_count() > 1:  # one decision for all: the restore is collective
        from jax.experimental import multihost_utils

        cached = bool(multihost_utils.broadcast_one_to_all(np.int32(cached)))
    if cached:
        return ckptr.restore((path / "params").absolute(), abstract), path
    params = train_base(cfg, model_cfg, tokenizer, train_source, progress)
    if jax.process_count() > 1:
        return jax.tree.map(np.asarray, params), path
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ckptr.save((tmp / "params").absolute(), params)
    ckptr.wait_until_finished()
    (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(cfg.warmstart)))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)  # atomic: a killed warm start never leaves a half-written cache entry
    return jax.tree.map(np.asarray, params), path
