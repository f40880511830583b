"""The teacher of on-policy distillation (`distill.teacher`): loaded once, frozen, and run once per step.

    check_teacher(cfg, loss)                          before any work: the path exists, the loss reads it
    teacher = load_teacher(cfg, tokenizer, mesh, preset)      its model, params (laid out by the preset)
    score = teacher_scorer(cfg, teacher, mesh, preset, parallel)
    batch = score(batch)                              + teacher_logp_BxT, one jitted forward

Where the forward runs: on the step's assembled batch, after the rollout and before the update, in a
program of its own (`teacher_scorer`). That is the rollout batch's scoring stage: the teacher's
log-probs are data for the loss (the advantage of `jaxrl.losses.distill`), computed once per step and
never inside the update's PPO epochs or mini-batches, and the teacher's params stay out of the
`TrainState`, so no checkpoint holds them and no optimizer sees them. The forward is the update's own
logp function (`steps.make_logp_fn`) on the teacher's architecture, at the rollout temperature (the
distribution the student samples from), over `train.microbatches` chunks of rows when that is set.

A teacher is a jaxrl run directory (its newest checkpoint; the model its config.json names; a LoRA
run's merged policy) or a Hugging Face checkpoint directory / `jaxrl convert --from-hf` output. Its
architecture may differ from the student's (depth, width, heads, MoE); its tokenizer may not: the
vocabulary size, the special ids and the text of every id are compared (`check_same_tokenizer`).
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from jaxrl.config import Config, ConfigError, ModelConfig
from jaxrl.losses import Loss
from jaxrl.losses.distill import TEACHER_KEY, reads_teacher
from jaxrl.policy import lora_run
from jaxrl.policy.pretrained import load_params, restore_saved_params
from jaxrl.policy.resolve import MODEL_CONFIG, resolve_policy, shardings_for
from jaxrl.sharding import named_sharding
from jaxrl.train.steps import make_logp_fn, microbatched_logp

FIELD = "distill.teacher"
IDS_COMPARED = 4096  # a larger vocabulary compares the text of its first and last IDS_COMPARED // 2 ids
FORWARD_KEYS = ("prompt_tokens_BxP", "prompt_mask_BxP", "tokens_BxT", "completion_mask_BxT")


class Teacher(NamedTuple):
    model_cfg: ModelConfig  # the teacher's architecture (the student's max_seq_len when it is longer)
    params: Any  # laid out by the run's mesh preset; never part of the TrainState
    tokenizer: Any
    origin: str  # the checkpoint directory read


def _kind(path: pathlib.Path) -> str:
    """ "run" (a jaxrl run directory) or "hf" (a Hugging Face / converted checkpoint directory)."""
    if (path / "config.json").is_file() and not (path / "tokenizer.json").is_file():
        return "run"  # a run directory: its config.json is jaxrl's (checked when it is read)
    if (path / "config.json").is_file() or (path / MODEL_CONFIG).is_file():
        return "hf"
    raise ConfigError(
        f"{FIELD}: {str(path)!r} is neither a jaxrl run directory (checkpoints/, config.json) nor a Hugging "
        "Face checkpoint directory (config.json, safetensors, tokenizer.json)"
    )


def _missing(cfg: Config, path: pathlib.Path) -> str:
    make = (
        f"; make it with (distill.teacher_command): {cfg.distill.teacher_command}"
        if cfg.distill.teacher_command
        else ""
    )
    return f"{FIELD}: {str(path)!r} does not exist{make}"


def check_teacher(cfg: Config, loss: Loss) -> None:
    """ConfigError naming distill.teacher when the loss and the teacher do not go together (a loss that
    reads teacher_logp_BxT without a teacher, or a teacher no part of the loss reads) or the teacher's
    directory does not exist (quoting distill.teacher_command, the command that makes it)."""
    wants = reads_teacher(loss)
    if wants and not cfg.distill.teacher:
        raise ConfigError(
            f"{FIELD}: empty, but loss {loss.name!r} scores the samples against a teacher; set it to a jaxrl "
            "run directory or a Hugging Face checkpoint directory"
        )
    if cfg.distill.teacher and not wants:
        raise ConfigError(
            f"{FIELD}: set to {cfg.distill.teacher!r}, but loss {loss.name!r} reads no teacher (use "
            "loss.preset='distill', or a composition with jaxrl.losses.distill.teacher_part)"
        )
    if wants:
        path = pathlib.Path(cfg.distill.teacher).expanduser()
        if not path.is_dir():
            raise ConfigError(_missing(cfg, path))
        if _kind(path) == "run":
            lora_run.newest_step_dir(path, field=FIELD)  # a run without a finished checkpoint: an error now


def check_same_tokenizer(student, teacher, where: str = FIELD) -> None:
    """ConfigError naming `where` when the two tokenizers differ: vocab_size, pad/bos/eos ids, or the
    text of an id (all ids up to IDS_COMPARED, else the first and last IDS_COMPARED // 2)."""
    for attr in ("vocab_size", "pad_id", "bos_id", "eos_id"):
        s, t = getattr(student, attr, None), getattr(teacher, attr, None)
        if s != t:
            raise ConfigError(
                f"{where}: the teacher's tokenizer has {attr}={t!r} but the student's {attr}={s!r}; "
                "distillation scores the student's token ids, so both need one tokenizer"
            )
    n = student.vocab_size
    ids = range(n) if n <= IDS_COMPARED else [*range(IDS_COMPARED // 2), *range(n - IDS_COMPARED // 2, n)]
    for i in ids:
        s, t = student.decode([i]), teacher.decode([i])
        if s != t:
            raise ConfigError(
                f"{where}: token id {i} is {t!r} to the teacher's tokenizer but {s!r} to the student's; "
                "distillation scores the student's token ids, so both need one tokenizer"
            )


def _resolved(cfg: Config, path: pathlib.Path) -> tuple[Any, ModelConfig]:
    """(tokenizer, model config) of the teacher at `path`, from its config files (no weights read)."""
    if _kind(path) == "run":
        resolved = resolve_policy(lora_run.run_config(path))
    else:
        resolved = resolve_policy(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_path=str(path))))
    return resolved.tokenizer, resolved.model_cfg


def _fitted(cfg: Config, model_cfg: ModelConfig) -> ModelConfig:
    """The teacher's config with max_seq_len raised to the student's when shorter (it scores the
    student's prompt + completion)."""
    if model_cfg.max_seq_len < cfg.model.max_seq_len:
        return dataclasses.replace(model_cfg, max_seq_len=cfg.model.max_seq_len)
    return model_cfg


def teacher_model_config(cfg: Config) -> ModelConfig:
    """The architecture of the teacher `distill.teacher` names, from its config files alone (for
    `jaxrl plan`): a run's config.json, or a checkpoint's config.json / model_config.json."""
    path = pathlib.Path(cfg.distill.teacher).expanduser()
    if not path.is_dir():
        raise ConfigError(_missing(cfg, path))
    return _fitted(cfg, _resolved(cfg, path)[1])


def _run_teacher(path: pathlib.Path, mesh, preset) -> tuple[ModelConfig, Any, Any, str]:
    run_cfg = lora_run.run_config(path)
    tokenizer, model_cfg = resolve_policy(run_cfg)
    step_dir = lora_run.newest_step_dir(path, field=FIELD)
    if run_cfg.model.lora.enabled:  # adapters on a base rebuilt as the run built it: the merged policy
        policy = lora_run.load_policy(run_cfg, step_dir)
        params = jax.device_put(policy.merged(), shardings_for(policy.model_cfg, mesh, preset))
        return policy.model_cfg, params, tokenizer, str(step_dir)
    return (
        model_cfg,
        restore_saved_params(
            step_dir,
            model_cfg,
            shardings_for(model_cfg, mesh, preset),
            lambda why: ConfigError(f"{FIELD}: {step_dir} does not restore as its run's model ({why})"),
        ),
        tokenizer,
        str(step_dir),
    )


def load_teacher(cfg: Config, student_tokenizer, mesh, preset) -> Teacher:
    """The teacher `distill.teacher` names (after `check_teacher`), its tokenizer checked against the
    student's and its params laid out by the run's mesh preset. Its max_seq_len is raised to the
    student's when shorter (the teacher scores the student's prompt + completion)."""
    path = pathlib.Path(cfg.distill.teacher).expanduser()
    if not path.is_dir():
        raise ConfigError(_missing(cfg, path))
    if _kind(path) == "run":
        model_cfg, params, tokenizer, origin = _run_teacher(path, mesh, preset)
    else:
        tokenizer, model_cfg = _resolved(cfg, path)
        params = load_params(path, model_cfg, shardings_for(model_cfg, mesh, preset))
        origin = str(path)
    check_same_tokenizer(student_tokenizer, tokenizer)
    return Teacher(_fitted(cfg, model_cfg), params, tokenizer, origin)


def teacher_logp_fn(cfg: Config, model_cfg: ModelConfig, parallel=None) -> Callable:
    """(teacher params, batch) -> teacher_logp_BxT: the teacher's log-probs of the batch's completion
    tokens at the rollout temperature, 0 on masked tokens, `train.microbatches` row chunks at a time
    (all rows at once when it is 0). The same forward as the update's (`steps.make_logp_fn`)."""
    from jaxrl.train.programs import prompt_groups

    logp_fn = make_logp_fn(
        model_cfg,
        cfg.rollout.temperature,
        prompt_groups=prompt_groups(cfg),
        logits_chunk=cfg.train.logits_chunk,
        parallel=parallel,
    )
    chunks = max(cfg.train.microbatches, 1)

    def teacher_logp(params, batch: dict) -> jax.Array:
        batch = {k: batch[k] for k in FORWARD_KEYS}
        logp_BxT = microbatched_logp(logp_fn, params, batch, chunks, parallel)[0]
        return jax.lax.stop_gradient(jax.numpy.where(batch["completion_mask_BxT"] > 0, logp_BxT, 0.0))

    return teacher_logp


def teacher_scorer(cfg: Config, teacher: Teacher, mesh, preset, parallel=None) -> Callable[[dict], dict]:
    """batch -> batch with `teacher_logp_BxT` (laid out like the batch's other _BxT fields): one
    jitted forward of the teacher per call, its params an argument of the program (not a constant)."""
    jitted = jax.jit(
        teacher_logp_fn(cfg, teacher.model_cfg, parallel), out_shardings=named_sharding(mesh, preset, TEACHER_KEY)
    )

    def score(batch: dict) -> dict:
        return {**batch, TEACHER_KEY: jitted(teacher.params, {k: batch[k] for k in FORWARD_KEYS})}

    return score
