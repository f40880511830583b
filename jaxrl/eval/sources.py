"""Where `jaxrl eval` finds the policy it scores, and loading it.

    --workdir W       the newest checkpoint of the run in W (or --step N)
    --checkpoint DIR  one step's directory (W/checkpoints/N), or a checkpoints root (newest, or --step N)
    --hf DIR          a Hugging Face checkpoint (or a `jaxrl convert --from-hf` output), before any training
    (none)            the config's initial policy: what step 0 of `jaxrl train` evaluates (model.hf_path,
                      else the cached warm start of the base policy, trained first when not cached)

`locate` checks the paths (no JAX work: a wrong path is an error at once); `load_policy` loads the
tokenizer, the model config and the params, laid out by the config's mesh preset. A jaxrl checkpoint
is read as the config's model (its tokenizer: model.hf_path's, else the character tokenizer); when the
run's config.json is next to it, a model.* field that differs from the config is an error naming it.
Only the params are read from the checkpoint (orbax partial restore), not the optimizer state.
A LoRA run's checkpoint holds adapters only: its policy is the base rebuilt as training builds it,
merged with them (jaxrl.policy.lora_run).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax

from jaxrl.config import Config, ConfigError

SOURCE_FLAGS = ("--workdir", "--checkpoint", "--hf")


class EvalError(ConfigError):
    """A mistake in what `jaxrl eval` was asked (a path, a flag); one line naming it (exit 2)."""


class Located(NamedTuple):
    kind: str  # "workdir" | "checkpoint" | "hf" | "initial"
    path: pathlib.Path | None  # what the user named
    step_dir: pathlib.Path | None  # the jaxrl checkpoint step directory read (workdir / checkpoint)
    step: int | None  # its step (None: hf, initial, or a step directory not named by a number)
    run_dir: pathlib.Path | None  # the run holding it, when its config.json is there


class Policy(NamedTuple):
    tokenizer: Any
    model_cfg: Any
    params: Any  # laid out by the mesh preset
    origin: str  # where the params came from (a checkpoint step dir, an HF dir, the warm-start cache)


def saved_steps(root: pathlib.Path) -> list[int]:
    """The finished steps under a checkpoints root (an unfinished save is `<step>.orbax-...-tmp-...`)."""
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and p.is_dir())


def _pick(root: pathlib.Path, step: int | None) -> tuple[pathlib.Path, int]:
    steps = saved_steps(root)
    if step is None:
        return root / str(steps[-1]), steps[-1]
    if step not in steps:
        raise EvalError(f"--step {step} was not saved in {root}; saved steps: {', '.join(map(str, steps))}")
    return root / str(step), step


def _run_dir(directory: pathlib.Path) -> pathlib.Path | None:
    return directory if (directory / "config.json").is_file() else None


def _existing_dir(flag: str, path: str) -> pathlib.Path:
    directory = pathlib.Path(path).expanduser()
    if not directory.is_dir():
        raise EvalError(f"{flag} {path}: directory not found")
    return directory


def locate(workdir: str | None, checkpoint: str | None, hf: str | None, step: int | None) -> Located:
    """Check the source flags and their paths; see the module docstring."""
    given = [f for f, v in zip(SOURCE_FLAGS, (workdir, checkpoint, hf)) if v is not None]
    if len(given) > 1:
        raise EvalError(f"give one source of {', '.join(SOURCE_FLAGS)} (or none: the initial policy); got {given}")
    if step is not None and not (workdir or checkpoint):
        raise EvalError(f"--step {step}: a step is chosen with --workdir or --checkpoint")
    if workdir is not None:
        run = _existing_dir("--workdir", workdir)
        if not saved_steps(run / "checkpoints"):
            raise EvalError(f"--workdir {workdir} has no checkpoints (no finished step in {run / 'checkpoints'})")
        step_dir, n = _pick(run / "checkpoints", step)
        return Located("workdir", run, step_dir, n, _run_dir(run))
    if checkpoint is not None:
        return _locate_checkpoint(_existing_dir("--checkpoint", checkpoint), step)
    if hf is not None:
        directory = _existing_dir("--hf", hf)
        if not (directory / "config.json").is_file() and not (directory / "model_config.json").is_file():
            raise EvalError(
                f"--hf {hf}: no config.json in it (a Hugging Face checkpoint directory has config.json, "
                "safetensors and tokenizer.json)"
            )
        return Located("hf", directory, None, None, None)
    return Located("initial", None, None, None, None)


def _locate_checkpoint(directory: pathlib.Path, step: int | None) -> Located:
    if (directory / "state").is_dir():  # one step's directory: <run>/checkpoints/<step>
        n = int(directory.name) if directory.name.isdigit() else None
        if step is not None and step != n:
            raise EvalError(
                f"--step {step}: --checkpoint {directory} is the directory of one step ({directory.name}); "
                "give its checkpoints root to choose a step"
            )
        return Located("checkpoint", directory, directory, n, _run_dir(directory.parent.parent))
    if not saved_steps(directory):
        hint = "; a run directory goes to --workdir" if (directory / "checkpoints").is_dir() else ""
        raise EvalError(
            f"--checkpoint {directory} holds no checkpoint: expected a step directory (with state/) or a "
            f"checkpoints root (numbered step folders){hint}"
        )
    step_dir, n = _pick(directory, step)
    return Located("checkpoint", directory, step_dir, n, _run_dir(directory.parent))


def run_model(cfg: Config, located: Located, overrides: Sequence[str] = ()) -> Config:
    """`cfg` with the model the run trained: its config.json's `model.*` (the checkpoint holds those
    weights, so no other model can be read from it). A `--set model.X=...` that differs from the run's
    is an error naming the field; without a config.json (or for --hf / the initial policy) `cfg` as is."""
    if located.run_dir is None:
        return cfg
    from jaxrl.config.saved import config_changes, read_run_config

    saved = read_run_config(located.run_dir)
    if saved is None:
        return cfg
    differ = {k: v for k, v in config_changes(saved, cfg).items() if k.startswith("model.")}
    asked = {o.split("=", 1)[0].strip() for o in overrides}
    clash = {k: v for k, v in differ.items() if k in asked}
    if clash:
        shown = ", ".join(f"{k}={new!r} but the run has {old!r}" for k, (old, new) in clash.items())
        raise EvalError(
            f"{located.run_dir / 'config.json'}: --set {shown}; the checkpoint holds the run's model "
            "(drop these --set flags)"
        )
    if not differ:
        return cfg
    from jaxrl.config.load import override

    model = cfg.model
    for k, (old, _) in differ.items():  # nested fields too (model.lora.rank)
        model = override(model, k.split(".", 1)[1], tuple(old) if isinstance(old, list) else old)
    print(
        f"jaxrl: the run's model from {located.run_dir / 'config.json'} ("
        + ", ".join(f"{k}={old!r}" for k, (old, _) in differ.items())
        + ")",
        file=sys.stderr,
    )
    return dataclasses.replace(cfg, model=model).validate()


def restore_params(step_dir: pathlib.Path, model_cfg, mesh, preset):
    """The params of a saved TrainState, laid out by the mesh preset (the optimizer state stays on disk)."""
    from jaxrl.policy.pretrained import restore_saved_params
    from jaxrl.policy.resolve import shardings_for

    def error(why: str) -> EvalError:
        return EvalError(
            f"{step_dir}: its params do not restore as the config's model ({why}); "
            "is this the run's config (model.* and --set)?"
        )

    return restore_saved_params(step_dir, model_cfg, shardings_for(model_cfg, mesh, preset), error)


def load_policy(cfg: Config, located: Located, mesh, preset, task, progress: bool) -> Policy:
    """The tokenizer, model config and params of the located source, placed by the mesh preset."""
    from jaxrl.policy.pretrained import load_params
    from jaxrl.policy.resolve import resolve_policy, shardings_for

    if located.kind == "hf" or (located.kind == "initial" and cfg.model.hf_path):
        path = pathlib.Path(located.path or cfg.model.hf_path)
        tokenizer, model_cfg = resolve_policy(
            dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_path=str(path)))
        )
        params = load_params(path.expanduser(), model_cfg, shardings_for(model_cfg, mesh, preset))
        return Policy(tokenizer, model_cfg, params, str(path))
    tokenizer, model_cfg = resolve_policy(cfg)
    if located.step_dir is not None and cfg.model.lora.enabled:
        return _lora_policy(cfg, located, mesh, preset, tokenizer)
    if located.step_dir is not None:
        return Policy(
            tokenizer, model_cfg, restore_params(located.step_dir, model_cfg, mesh, preset), str(located.step_dir)
        )
    from jaxrl.data.tokenizer import CharTokenizer
    from jaxrl.policy.base import start_params

    assert isinstance(tokenizer, CharTokenizer)  # model.hf_path's policy returned above
    shardings = shardings_for(model_cfg, mesh, preset)
    params, path = start_params(cfg, model_cfg, tokenizer, task.train, progress, shardings)
    return Policy(tokenizer, model_cfg, jax.device_put(params, shardings), str(path))


def _lora_policy(cfg: Config, located: Located, mesh, preset, tokenizer) -> Policy:
    """A LoRA checkpoint's merged policy: the base rebuilt from the run's own config (its warm-start key
    depends on data.*, warmstart.*, ...) when its config.json is there, else from `cfg`."""
    from jaxrl.policy import lora_run
    from jaxrl.policy.resolve import shardings_for

    assert located.step_dir is not None
    run_cfg = lora_run.run_config(located.run_dir) if located.run_dir is not None else cfg
    policy = lora_run.load_policy(run_cfg, located.step_dir, mesh, preset)
    shardings = shardings_for(policy.model_cfg, mesh, preset)
    return Policy(tokenizer, policy.model_cfg, jax.device_put(policy.merged(), shardings), str(located.step_dir))
