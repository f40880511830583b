"""Frozen run configuration: dataclasses, config-file loading, `--set a.b=v` overrides, validation.

A config file is a Python file under `configs/` defining `get_config() -> Config`. Every user mistake
(unknown field, wrong type, out-of-range value, missing file) raises `ConfigError` with one line that
names the field or file and what is allowed.
"""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
from typing import Any

from jaxrl.config.agent import AgentConfig
from jaxrl.config.checks import _check, _check_finite_floats, _check_learning_rate
from jaxrl.config.critic import CriticConfig
from jaxrl.config.distill import DistillConfig
from jaxrl.config.errors import ConfigError
from jaxrl.config.load import load_file
from jaxrl.config.model import ModelConfig
from jaxrl.config.reward_model import RewardModelConfig
from jaxrl.config.rollout import RolloutConfig
from jaxrl.config.train import TrainConfig


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The prompt source. `task` names a registered task (jaxrl.data.registry): a built-in TFDS task,
    whose builder caches under `data_dir`, an environment, or a task a config file registered."""

    task: str = "arithmetic"
    digits: int = 2
    operations: str = "+"
    num_train: int = 8000
    num_test: int = 500
    max_prompt_len: int = 16
    skip_long_prompts: bool = False
    data_dir: str = ""  # "" -> $JAXRL_DATA_DIR or ~/.cache/jaxrl/tfds
    seed: int = 0
    # task="math_jsonl" (jaxrl.data.math_jsonl): local GSM8K-style JSONL files and the prompt format.
    train_file: str = ""
    test_file: str = ""  # "" -> the last num_test lines of train_file are held out
    prompt_template: str = "{question}"

    def validate(self, prefix: str = "data") -> None:
        # The one lookup upward: the registry (jaxrl.data.registry) holds the built-in tasks and those a
        # config file registered before its get_config() ran; a task's own checks name data.* fields.
        task = importlib.import_module("jaxrl.data.registry").get_task(self.task, f"{prefix}.task")
        if task.check is not None:
            task.check(self, prefix)
        _check(
            "{question}" in self.prompt_template,
            f"{prefix}.prompt_template",
            "a string containing '{question}'",
            self.prompt_template,
        )
        _check(self.num_train > 0, f"{prefix}.num_train", "a positive integer", self.num_train)
        _check(self.num_test > 0, f"{prefix}.num_test", "a positive integer", self.num_test)
        _check(self.max_prompt_len > 0, f"{prefix}.max_prompt_len", "a positive integer", self.max_prompt_len)


_OPTION_TYPES = (bool, int, float, str, type(None))


def _option_word(raw: str) -> Any:
    """An option's value as written after `name=`: a number, true/false, none, or a bare word."""
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for number in (int, float):
        try:
            return number(raw)
        except ValueError:
            pass
    return raw


def _checked_options(options: dict, field: str) -> dict:
    for name, value in options.items():
        if not (isinstance(name, str) and name.isidentifier()):
            raise ConfigError(f"{field}: key {name!r} is not a name (e.g. {{'tau': 0.04}})")
        if not isinstance(value, _OPTION_TYPES):
            raise ConfigError(
                f"{field}[{name!r}]: got {type(value).__name__}, expected a number, bool, None or word "
                "(code belongs in a registered preset: jaxrl.losses.register_preset)"
            )
    return dict(options)


def parse_loss_options(options: str | dict, field: str = "loss.options") -> dict:
    """The loss options as {name: value}: a dict (a Python config) is checked and copied; a string
    (`--set`), `"tau=0.04, is_level=sequence, mask_truncated=true"`, is parsed, its values numbers,
    true/false, none, or a bare word (kept as a string). Names and values only; which names a preset
    accepts is checked by `jaxrl.losses.make_loss`."""
    if isinstance(options, dict):
        return _checked_options(options, field)
    if not isinstance(options, str):
        raise ConfigError(f"{field}: got {type(options).__name__}, expected a dict or a 'name=value, ...' string")
    out = {}
    for item in (i.strip() for i in options.split(",")):
        if not item:
            continue
        name, sep, raw = (x.strip() for x in item.partition("="))
        if not sep or not name.isidentifier() or not raw:
            raise ConfigError(f"{field}: got {options!r}, expected comma-separated name=value pairs (e.g. 'tau=0.04')")
        if name in out:
            raise ConfigError(f"{field}: {name!r} is given twice in {options!r}")
        out[name] = _option_word(raw)
    return out


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The loss preset and its hyperparameters.

    preset: a registered name (`jaxrl variants`; `jaxrl.losses.register_preset` adds one, e.g. from the
    config file itself) or "module:attr", a factory, `Preset` or `Loss` importable from PYTHONPATH.
    eps_low / eps_high / adv_eps: None means the preset's paper default (e.g. DAPO's 0.28, GSPO's
    4e-4); a value is an error for a preset without that parameter. `options`: the preset's other
    parameters and the options every preset takes, as a dict in a Python config ({"tis_cap": 2.0,
    "is_level": "sequence"}) or comma-separated name=value pairs ("tau=0.02", from `--set`); both
    are checked the same way by `jaxrl.losses.make_loss`.
    reward_weights: one weight per reward function, i.e. per column of rewards_BxK (the arithmetic
    task's are (correctness, format); its configs set them); None weighs every column 1, for any K.
    """

    preset: str = "grpo"
    eps_low: float | None = None
    eps_high: float | None = None
    kl_beta: float = 0.0
    adv_eps: float | None = None
    reward_weights: tuple | None = None  # one per reward function (rewards_BxK column); None = all 1
    options: str | dict = ""  # a dict in Python configs, a string from --set loss.options=...

    def validate(self, prefix: str = "loss") -> None:
        _check(
            self.eps_low is None or self.eps_low >= 0,
            f"{prefix}.eps_low",
            "None or a non-negative number",
            self.eps_low,
        )
        _check(
            self.eps_high is None or self.eps_high >= 0,
            f"{prefix}.eps_high",
            "None or a non-negative number",
            self.eps_high,
        )
        _check(self.kl_beta >= 0, f"{prefix}.kl_beta", "a non-negative number", self.kl_beta)
        _check(self.adv_eps is None or self.adv_eps > 0, f"{prefix}.adv_eps", "None or a positive number", self.adv_eps)
        _check(
            self.reward_weights is None or len(self.reward_weights) > 0,
            f"{prefix}.reward_weights",
            "None (all 1) or one weight per reward function",
            self.reward_weights,
        )
        parse_loss_options(self.options, f"{prefix}.options")


OPTIM_STATE_DTYPES = ("float32", "bfloat16")
OPTIM_STATE_MEMORIES = ("device", "pinned_host")
BF16_HALF_STEP = 2.0**-8  # the largest relative rounding step of bfloat16 (7 stored mantissa bits), halved


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = 3e-4
    warmup_steps: int = 5
    decay_steps: int = 0  # 0 -> train.steps * train.ppo_epochs * train.minibatches (optimizer updates)
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.99
    grad_clip: float = 1.0
    # What AdamW keeps its two moments in between updates (jaxrl.train.state.make_optimizer): float32, or
    # bfloat16 (half the optimizer state's memory; each update still computes in float32 and rounds once).
    state_dtype: str = "float32"
    # Where the optimizer state lives between updates: "device", or "pinned_host" (JAX memory kinds: host
    # RAM, moved to the device inside each update and back; jaxrl.train.state.opt_state_in).
    state_memory: str = "device"

    def validate(self, prefix: str = "optim") -> None:
        _check_learning_rate(self.learning_rate, f"{prefix}.learning_rate")
        _check(self.warmup_steps >= 0, f"{prefix}.warmup_steps", "a non-negative integer", self.warmup_steps)
        _check(self.decay_steps >= 0, f"{prefix}.decay_steps", "a non-negative integer", self.decay_steps)
        _check(0 <= self.end_lr_ratio <= 1, f"{prefix}.end_lr_ratio", "a number in [0, 1]", self.end_lr_ratio)
        _check(self.weight_decay >= 0, f"{prefix}.weight_decay", "a non-negative number", self.weight_decay)
        _check(0 <= self.b1 < 1, f"{prefix}.b1", "a number in [0, 1)", self.b1)
        _check(0 <= self.b2 < 1, f"{prefix}.b2", "a number in [0, 1)", self.b2)
        _check(self.grad_clip > 0, f"{prefix}.grad_clip", "a positive number", self.grad_clip)
        dtypes = OPTIM_STATE_DTYPES
        _check(self.state_dtype in dtypes, f"{prefix}.state_dtype", " or ".join(map(repr, dtypes)), self.state_dtype)
        memories = OPTIM_STATE_MEMORIES
        _check(
            self.state_memory in memories, f"{prefix}.state_memory", " or ".join(map(repr, memories)), self.state_memory
        )
        # A bfloat16 second moment must still shrink on a step with no gradient: b2 * nu rounds back to nu
        # once 1 - b2 is under bfloat16's relative half-step (2**-8 at worst), and nu would then never decay.
        _check(
            self.state_dtype != "bfloat16" or 1 - self.b2 > BF16_HALF_STEP,
            f"{prefix}.b2",
            f"below {1 - BF16_HALF_STEP:.5f} with {prefix}.state_dtype='bfloat16' (else bfloat16 nu never decays)",
            self.b2,
        )


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
    """Supervised warm start that makes the base policy; cached on disk under `cache_dir`."""

    steps: int = 300
    batch_size: int = 64
    learning_rate: float = 1e-3
    teacher_error: float = 0.0  # share of demonstrations from a fallible teacher (jaxrl.data.teachers)
    cache_dir: str = ""  # "" -> $JAXRL_CACHE_DIR or ~/.cache/jaxrl/warmstart
    seed: int = -1  # -1: train.seed. Set it to share one base policy between runs of different train.seed
    # What the run starts from: "teacher" (a warm start on a text task's reference answers, an environment's
    # teacher), "demonstrations" (on an environment's given episodes), "none" (the initial model: RL only),
    # "checkpoint" (the newest checkpoint's params of the run directory `checkpoint`). model.hf_path
    # (a Hugging Face checkpoint) replaces all of them.
    source: str = "teacher"
    checkpoint: str = ""

    def validate(self, prefix: str = "warmstart") -> None:
        _check(self.steps >= 0, f"{prefix}.steps", "a non-negative integer (0 = random init)", self.steps)
        _check(self.batch_size > 0, f"{prefix}.batch_size", "a positive integer", self.batch_size)
        _check_learning_rate(self.learning_rate, f"{prefix}.learning_rate")
        _check(0 <= self.teacher_error <= 1, f"{prefix}.teacher_error", "a number in [0, 1]", self.teacher_error)
        _check(self.seed >= -1, f"{prefix}.seed", "-1 (train.seed) or a non-negative integer", self.seed)
        sources = ("teacher", "demonstrations", "none", "checkpoint")
        _check(self.source in sources, f"{prefix}.source", " or ".join(map(repr, sources)), self.source)
        _check(
            (self.source == "checkpoint") == bool(self.checkpoint),
            f"{prefix}.checkpoint",
            "a run directory exactly when warmstart.source='checkpoint'",
            self.checkpoint,
        )


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 10
    keep: int = 3
    async_save: bool = True

    def validate(self, prefix: str = "checkpoint") -> None:
        _check(self.every >= 0, f"{prefix}.every", "a non-negative integer (0 = only at the end)", self.every)
        _check(self.keep > 0, f"{prefix}.keep", "a positive integer", self.keep)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """How devices are laid out (jaxrl.sharding.PRESETS). `single`: one device; `data`: batch over
    all devices, params replicated; `fsdp`: batch and params' embed axis over all devices;
    `fsdp_tensor`: (fsdp, tensor) with mlp/heads/vocab over `tensor`; `fsdp_expert`: (fsdp, expert)
    with experts over `expert`. fsdp is the devices left over: devices / tensor (or / expert).

    allow_replicated: parameter paths (fnmatch patterns such as "blocks/attn/k", "blocks/*" or "*")
    whose dimensions that do not divide over their mesh axis are replicated; for any other parameter such
    a dimension is an error naming it (jaxrl.sharding.spec_for). () = none allowed."""

    preset: str = "single"
    tensor: int = 1  # size of the tensor axis (fsdp_tensor only)
    expert: int = 1  # size of the expert axis (fsdp_expert only)
    allow_replicated: tuple[str, ...] = ()

    def validate(self, prefix: str = "mesh") -> None:
        presets = ("single", "data", "fsdp", "fsdp_tensor", "fsdp_expert")
        _check(self.preset in presets, f"{prefix}.preset", " or ".join(map(repr, presets)), self.preset)
        for name, owner in (("tensor", "fsdp_tensor"), ("expert", "fsdp_expert")):
            v = getattr(self, name)
            _check(v > 0, f"{prefix}.{name}", "a positive integer", v)
            _check(
                v == 1 or self.preset == owner,
                f"{prefix}.{name}",
                f"1 unless mesh.preset={owner!r} (preset is {self.preset!r})",
                v,
            )
        for pattern in self.allow_replicated:
            _check(
                isinstance(pattern, str) and pattern.strip() == pattern and pattern != "",
                f"{prefix}.allow_replicated",
                "parameter path patterns such as 'blocks/attn/k' or '*' (non-empty, no surrounding spaces)",
                self.allow_replicated,
            )
            _check(
                pattern.count("[") == pattern.count("]"),
                f"{prefix}.allow_replicated",
                "patterns with balanced [...] (--set drops a trailing ']': end the pattern with '*' or set it in "
                "the config file)",
                self.allow_replicated,
            )


LOG_BACKENDS = ("jsonl", "tensorboard", "wandb", "mlflow")
WANDB_MODES = ("offline", "online")


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """Where each step's metrics row goes besides `metrics.jsonl` (always written: resume and the plots read
    it). backends: any of "jsonl", "tensorboard" (both by default), "wandb", "mlflow" (their own libraries,
    the optional extras `pip install 'jaxrl[wandb]'` / `'jaxrl[mlflow]'`; jaxrl.runlog.trackers). Only
    process 0 logs; a tracker's run id is kept in the workdir, so a resumed run continues the same run.
    project: the W&B project and the MLflow experiment; run_name: "" -> the workdir's name.
    wandb_mode: "offline" (the default: files under <workdir>/wandb, `wandb sync` uploads them) or
    "online". mlflow_tracking_uri: "" -> MLflow's own default ($MLFLOW_TRACKING_URI), e.g.
    "file:/path/mlruns" (a local store) or "http://host:5000"."""

    backends: tuple[str, ...] = ("jsonl", "tensorboard")
    project: str = "jaxrl"
    run_name: str = ""
    wandb_mode: str = "offline"
    wandb_entity: str = ""
    mlflow_tracking_uri: str = ""

    def validate(self, prefix: str = "log") -> None:
        allowed = " and ".join((", ".join(map(repr, LOG_BACKENDS[:-1])), repr(LOG_BACKENDS[-1])))
        for name in self.backends:
            _check(name in LOG_BACKENDS, f"{prefix}.backends", f"names from {allowed}", self.backends)
        _check(len(set(self.backends)) == len(self.backends), f"{prefix}.backends", "each name once", self.backends)
        _check(
            "jsonl" in self.backends,
            f"{prefix}.backends",
            "a tuple that includes 'jsonl' (metrics.jsonl is what a resume and the plots read)",
            self.backends,
        )
        _check(self.project.strip() != "", f"{prefix}.project", "a non-empty name", self.project)
        modes = " or ".join(map(repr, WANDB_MODES))
        _check(self.wandb_mode in WANDB_MODES, f"{prefix}.wandb_mode", modes, self.wandb_mode)


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    loss: LossConfig = LossConfig()
    optim: OptimConfig = OptimConfig()
    warmstart: WarmStartConfig = WarmStartConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    mesh: MeshConfig = MeshConfig()
    agent: AgentConfig = AgentConfig()
    log: LogConfig = LogConfig()
    critic: CriticConfig = CriticConfig()  # the value model (PPO); off by default
    distill: DistillConfig = DistillConfig()
    reward_model: RewardModelConfig = RewardModelConfig()

    def validate(self) -> Config:
        for f in dataclasses.fields(self):
            _check_finite_floats(getattr(self, f.name), f.name)
            getattr(self, f.name).validate(f.name)
        _check(
            not (self.model.hf_path and self.warmstart.source == "checkpoint"),
            "warmstart.source",
            "not 'checkpoint' with model.hf_path (the run starts from that Hugging Face checkpoint)",
            self.warmstart.source,
        )
        self._check_rollout_layout()
        _check(
            self.train.packing == "off" or not self.model.n_experts,
            "train.packing",
            "'off' for an MoE model (model.n_experts > 0: routing with capacity depends on the packs)",
            self.train.packing,
        )
        weights = self.loss.reward_weights
        _check(
            not self.reward_model.workdir or weights is None or len(weights) == 3,
            "loss.reward_weights",
            "None or 3 weights (correctness, format, reward model) with reward_model.workdir set",
            weights,
        )
        b = self.rollout.prompts_per_step * self.rollout.group_size
        _check(
            b % self.train.minibatches == 0,
            "train.minibatches",
            f"a divisor of the rollout batch prompts_per_step*group_size={b}",
            self.train.minibatches,
        )
        rows = b // self.train.minibatches
        _check(
            self.train.microbatches == 0 or rows % self.train.microbatches == 0,
            "train.microbatches",
            f"a divisor of the rows per optimizer step, prompts_per_step*group_size/train.minibatches={rows}",
            self.train.microbatches,
        )
        return self

    def _check_rollout_layout(self) -> None:
        """rollout.mesh.preset against the training mesh: the same devices (not one), and no expert axis
        (the rollout's MoE dispatch must split experts as the update's, which routing replay relies on)."""
        rm = self.rollout.mesh
        if not rm.preset:
            return
        _check(
            self.mesh.preset != "single",
            "rollout.mesh.preset",
            "'' with mesh.preset='single' (a rollout layout uses the training mesh's devices; there is one)",
            rm.preset,
        )
        _check(
            self.mesh.preset != "fsdp_expert",
            "rollout.mesh.preset",
            "'' with mesh.preset='fsdp_expert' (the rollout must split the experts as the update does)",
            rm.preset,
        )


def load_config(path: str | pathlib.Path, overrides: list[str] | None = None) -> Config:
    """Load `get_config()` from a config file, apply `--set` overrides, check types and ranges."""
    return load_file(path, Config, overrides).validate()
