"""`jaxrl reward-model train CONFIG --workdir W`: a scalar reward model from preference pairs.

    run = train_reward_model(cfg, workdir)   # -> the metric rows written (also W/metrics.jsonl)

The pairs come from reward_model.pairs_file (JSONL) or reward_model.synthetic; the backbone is the
run's `model.*` shape, fresh (reward_model.init='scratch') or the run's base policy ('base': the cached
warm start, or model.hf_path). Each step draws reward_model.batch_size pairs (a fresh permutation each
epoch, a function of the seed and the epoch only) and takes an AdamW step on the Bradley-Terry loss.
Held-out pair accuracy (rm/test_accuracy) is logged every reward_model.eval_every steps. The state
(params, optimizer, step) is checkpointed with orbax under W/checkpoints; rerunning the command on the
same workdir resumes from the newest checkpoint, and W/reward_model.json records what a scorer needs to
rebuild the model (its ModelConfig and tokenizer).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

from jaxrl.config import Config, ConfigError, ModelConfig, to_dict
from jaxrl.config.errors import RunError
from jaxrl.policy.resolve import resolve_policy
from jaxrl.rewards.model import init_reward_model, pair_loss, sequence_scores
from jaxrl.rewards.pairs import read_pairs, synthetic_pairs, tokenize_pairs
from jaxrl.runlog.metrics import MetricsLog

RECORD = "reward_model.json"  # next to checkpoints/: the model config and tokenizer of the reward model
EVAL_CHUNK = 256  # held-out pairs per jitted scoring call


def load_pairs(cfg: Config):
    """(train pairs, test pairs) of the config: the JSONL files, or the synthetic generator's."""
    rm = cfg.reward_model
    if not rm.pairs_file:
        return synthetic_pairs(rm.synthetic, cfg.data.digits, rm.num_train, rm.num_test, cfg.data.seed)
    if rm.test_file:
        train = read_pairs(rm.pairs_file, rm.num_train)
        test = read_pairs(rm.test_file, rm.num_test, field="reward_model.test_file")
        return train, test
    both = read_pairs(rm.pairs_file, rm.num_train + rm.num_test)
    if len(both) < 2:
        raise ConfigError(f"reward_model.pairs_file: {rm.pairs_file} has {len(both)} pair; hold-out needs at least 2")
    n_test = min(rm.num_test, len(both) // 2)
    return both[:-n_test], both[-n_test:]


def _backbone(cfg: Config):
    """The starting backbone params for reward_model.init='base' (None for 'scratch')."""
    if cfg.reward_model.init == "scratch":
        return None
    from jaxrl.policy.base import build_base
    from jaxrl.sharding import make_mesh

    mesh, preset = make_mesh(cfg.mesh)
    _, _, _, params, _, _ = build_base(cfg, cfg.reward_model.progress, mesh, preset)
    return params


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    rm = cfg.reward_model
    schedule = optax.linear_schedule(rm.learning_rate / max(rm.warmup_steps, 1), rm.learning_rate, rm.warmup_steps)
    return optax.adamw(schedule if rm.warmup_steps else rm.learning_rate, weight_decay=0.0)


def train_step_fn(model_cfg: ModelConfig, optimizer: optax.GradientTransformation):
    """The jitted step: (state, pairs) -> (state, metrics); state = {"params", "opt_state", "step"}."""

    @jax.jit
    def step(state, pairs):
        (loss, metrics), grads = jax.value_and_grad(pair_loss, has_aux=True)(state["params"], model_cfg, pairs)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, {"loss": loss, **metrics}

    return step


def held_out_accuracy(params, model_cfg: ModelConfig, test: dict) -> tuple[float, float]:
    """(pair accuracy, mean Bradley-Terry loss) over every held-out pair, EVAL_CHUNK pairs per call (the
    last chunk padded with its first pair and the padding left out)."""
    n = len(test["chosen_BxS"])
    chunk = min(EVAL_CHUNK, n)
    correct, loss_sum = 0.0, 0.0
    for start in range(0, n, chunk):
        idx = np.arange(start, start + chunk)
        live = idx < n
        part = {k: v[np.where(live, idx, start)] for k, v in test.items()}
        margin_B = _margins(params, model_cfg, part)
        margin_B = np.asarray(margin_B)[live]
        correct += float((margin_B > 0).sum())
        loss_sum += float(np.logaddexp(0.0, -margin_B).sum())
    return correct / n, loss_sum / n


@jax.jit
def _chosen_minus_rejected(scores_2B):
    B = scores_2B.shape[0] // 2
    return scores_2B[:B] - scores_2B[B:]


def _margins(params, model_cfg: ModelConfig, pairs: dict):
    tokens = np.concatenate([pairs["chosen_BxS"], pairs["rejected_BxS"]])
    masks = np.concatenate([pairs["chosen_mask_BxS"], pairs["rejected_mask_BxS"]])
    return _chosen_minus_rejected(sequence_scores(params, model_cfg, tokens, masks))


def epoch_batch(n: int, batch: int, seed: int, step: int) -> np.ndarray:
    """The pair indices of (0-based) `step`: consecutive slices of one permutation per epoch, each
    permutation a function of (seed, epoch) only, so a resumed run draws what the first would have."""
    per_epoch = max(n // batch, 1)
    epoch, k = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    idx = order[k * batch : (k + 1) * batch]
    return idx if len(idx) == batch else np.resize(order, batch)  # fewer pairs than one batch: wrap around


def write_record(workdir: pathlib.Path, model_cfg: ModelConfig, tokenizer, cfg: Config) -> None:
    """W/reward_model.json: the ModelConfig, the tokenizer (a character alphabet or model.hf_path) and the
    whole config that trained it."""
    record = {
        "config": to_dict(cfg),
        "model": dataclasses.asdict(model_cfg),
        "alphabet": getattr(tokenizer, "alphabet", None),
        "hf_path": cfg.model.hf_path,
    }
    (workdir / RECORD).write_text(json.dumps(record, indent=1, sort_keys=True))


def train_reward_model(cfg: Config, workdir: str | pathlib.Path) -> list[dict]:
    """Train (or resume) the reward model of `cfg` in `workdir`; -> the metric rows written this session."""
    rm, workdir = cfg.reward_model, pathlib.Path(workdir)
    tokenizer, model_cfg = resolve_policy(cfg)
    train_pairs, test_pairs = load_pairs(cfg)
    field = "reward_model.pairs_file" if rm.pairs_file else "reward_model.synthetic"
    S = model_cfg.max_seq_len
    train = tokenize_pairs(train_pairs, tokenizer, S, field)
    test = tokenize_pairs(test_pairs, tokenizer, S, "reward_model.test_file" if rm.test_file else field)
    workdir.mkdir(parents=True, exist_ok=True)
    optimizer = make_optimizer(cfg)
    manager = ocp.CheckpointManager(
        workdir.absolute() / "checkpoints", options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    )
    state, start = _initial_or_restored(cfg, model_cfg, optimizer, manager)
    write_record(workdir, model_cfg, tokenizer, cfg)
    log = MetricsLog(workdir, start, tensorboard=False)
    step_fn = train_step_fn(model_cfg, optimizer)
    bar = tqdm(range(start, rm.steps), desc="reward model", disable=not rm.progress, leave=False, file=sys.stderr)
    t0, rows = time.perf_counter(), []
    for i in bar:
        idx = epoch_batch(len(train_pairs), rm.batch_size, rm.seed, i)
        state, metrics = step_fn(state, {k: v[idx] for k, v in train.items()})
        step = i + 1
        row = {
            "step": step,
            "rm/loss": float(metrics["loss"]),
            "rm/accuracy": float(metrics["accuracy"]),
            "rm/margin": float(metrics["margin"]),
        }
        if not math.isfinite(row["rm/loss"]):
            raise RunError(
                f"reward model: the loss is {row['rm/loss']} at step {step} (the last checkpoint is kept); "
                "lower reward_model.learning_rate"
            )
        if step % rm.eval_every == 0 or step == rm.steps:
            row["rm/test_accuracy"], row["rm/test_loss"] = held_out_accuracy(state["params"], model_cfg, test)
            bar.set_postfix(test_acc=f"{row['rm/test_accuracy']:.3f}", loss=f"{row['rm/loss']:.3f}")
        row["rm/seconds"] = time.perf_counter() - t0
        log.write(row)
        rows.append(row)
        if (rm.checkpoint_every and step % rm.checkpoint_every == 0) or step == rm.steps:
            manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
    manager.wait_until_finished()
    log.close()
    return rows


def _initial_or_restored(cfg: Config, model_cfg: ModelConfig, optimizer, manager) -> tuple[dict, int]:
    """(state, steps done): the newest checkpoint in the workdir, else a fresh state."""
    latest = manager.latest_step()
    if latest is None:
        params = init_reward_model(model_cfg, jax.random.key(cfg.reward_model.seed), _backbone(cfg))
        return {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}, 0
    params = jax.eval_shape(lambda: init_reward_model(model_cfg, jax.random.key(0)))
    abstract = jax.eval_shape(
        lambda p: {"params": p, "opt_state": optimizer.init(p), "step": jnp.zeros((), jnp.int32)}, params
    )
    restored = manager.restore(latest, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
    return restored["state"], latest


def load_reward_model(workdir: str | pathlib.Path, field: str = "reward_model.workdir"):
    """(params, ModelConfig, record) of the newest checkpoint of a `jaxrl reward-model train` workdir;
    a workdir without one is a ConfigError naming `field`."""
    workdir = pathlib.Path(workdir).expanduser()
    if not (workdir / RECORD).is_file():
        raise ConfigError(f"{field}: {str(workdir)!r} has no {RECORD} (train one with `jaxrl reward-model train`)")
    record = json.loads((workdir / RECORD).read_text())
    model_cfg = ModelConfig.from_dict(record["model"])
    latest = ocp.CheckpointManager(workdir.absolute() / "checkpoints").latest_step()
    if latest is None:
        raise ConfigError(f"{field}: {str(workdir)!r} has no checkpoint under checkpoints/")
    target = {"params": jax.eval_shape(lambda: init_reward_model(model_cfg, jax.random.key(0)))}
    restored = ocp.PyTreeCheckpointer().restore(
        (workdir / "checkpoints" / str(latest) / "state").absolute(),
        args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
        ),
    )
    return restored["params"], model_cfg, record
