"""`jaxrl convert`: a Hugging Face checkpoint to jaxrl's own layout, and a jaxrl run (or a converted
directory) back to a Hugging Face checkpoint, LoRA runs also as base + PEFT adapter.

    jaxrl convert --from-hf HF_DIR --to OUT          # -> Orbax params + model_config.json + tokenizer files
    jaxrl convert --from RUN_OR_OUT --to-hf HF_DIR   # a converted dir, or a run's latest checkpoint -> HF

An export loads and generates with transformers alone: config.json, safetensors, generation_config.json
(bos / eos / pad), and the tokenizer: the checkpoint's own files (chat_template.jinja included) for a
run from model.hf_path, else the run's character tokenizer as tokenizer.json (the `hf` extra).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxrl.config import ConfigError, ModelConfig
from jaxrl.data.hf_tokenizer import save_char_tokenizer
from jaxrl.data.tokenizer import CharTokenizer
from jaxrl.models import hf, peft_export
from jaxrl.models.transformer import abstract_params
from jaxrl.policy import lora_run
from jaxrl.policy.pretrained import SIDE_FILES, load_model
from jaxrl.policy.resolve import MODEL_CONFIG, resolve_policy


def _copy_side_files(src: pathlib.Path, dst: pathlib.Path) -> None:
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)


def convert_from_hf(src, dst) -> ModelConfig:
    """A HF checkpoint directory -> Orbax params + model_config.json + its tokenizer files."""
    src, dst = pathlib.Path(src), pathlib.Path(dst)
    cfg, params = hf.load(src)  # max_seq_len: the checkpoint's; a run replaces it with its own
    if (dst / "params").exists():
        raise ConfigError(f"--to {str(dst)!r}: already holds converted params; choose a new directory")
    dst.mkdir(parents=True, exist_ok=True)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save((dst / "params").absolute(), params)
    ckptr.wait_until_finished()
    (dst / MODEL_CONFIG).write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    _copy_side_files(src, dst)
    if (src / "config.json").is_file():
        shutil.copyfile(src / "config.json", dst / "config.json")
    return cfg


def _run_params(run: pathlib.Path):
    """(model_cfg, params, tokenizer: the source dir of its files, or the run's CharTokenizer) of a run's
    newest checkpoint; a LoRA run's params are its merged policy (the base rebuilt, jaxrl.policy.lora_run)."""
    run_cfg = lora_run.run_config(run)  # a torn or foreign config.json is an error naming it
    if lora_run.is_lora_run(run):
        policy = lora_run.run_policy(run)
        side = policy.tokenizer_dir or resolve_policy(run_cfg).tokenizer  # a character run's tokenizer
        return policy.model_cfg, jax.tree.map(np.asarray, policy.merged()), side
    resolved = resolve_policy(run_cfg)  # an environment's run: its suite's alphabet
    cfg = resolved.model_cfg
    side = pathlib.Path(run_cfg.model.hf_path) if run_cfg.model.hf_path else resolved.tokenizer
    manager = ocp.CheckpointManager((run / "checkpoints").absolute())
    step = manager.latest_step()
    if step is None:
        raise ConfigError(f"--from {str(run)!r}: the run has no finished checkpoint")
    with warnings.catch_warnings():  # restored on the host for export: no topology to mismatch
        warnings.filterwarnings("ignore", message="Sharding info not provided when restoring")
        restored = ocp.PyTreeCheckpointer().restore((run / "checkpoints" / str(step) / "state").absolute())
    params = restored["params"] if isinstance(restored, dict) else restored[1]
    return cfg, jax.tree.map(np.asarray, params), side


def convert_to_hf(src, dst, dtype: str = "float32", max_shard_bytes: int = 0, peft_dir=None) -> ModelConfig:
    """A converted directory, or a run directory's newest checkpoint -> a HF checkpoint directory.
    With `peft_dir` (a LoRA run only): `dst` gets the frozen base policy and `peft_dir` the adapters as
    a PEFT adapter directory whose base is `dst` (jaxrl.models.peft_export)."""
    src, dst = pathlib.Path(src), pathlib.Path(dst)
    if peft_dir is not None:
        return _convert_to_peft(src, dst, pathlib.Path(peft_dir), dtype, max_shard_bytes)
    if (src / MODEL_CONFIG).is_file():
        cfg, params = load_model(ModelConfig(hf_path=str(src)))
        side = src
    elif (src / "checkpoints").is_dir() and (src / "config.json").is_file():
        cfg, params, side = _run_params(src)
    else:
        raise ConfigError(
            f"--from {str(src)!r}: expected a `jaxrl convert --from-hf` output ({MODEL_CONFIG}) or a "
            "run directory (config.json + checkpoints/)"
        )
    _save_hf(dst, params, cfg, side, dtype, max_shard_bytes)
    return cfg


TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _save_hf(
    dst: pathlib.Path, params, cfg: ModelConfig, side: pathlib.Path | CharTokenizer, dtype: str, max_shard_bytes: int
) -> None:
    """The HF checkpoint and its tokenizer. side: the directory of the tokenizer files to copy (with
    their config.json's token ids), or the run's character tokenizer to write as such files."""
    if isinstance(side, CharTokenizer):
        extra = dict(zip(TOKEN_IDS, (side.bos_id, side.eos_id, side.pad_id)))
        save_char_tokenizer(side, dst, cfg.max_seq_len)  # first: a missing `tokenizers` fails before any write
    else:
        original = json.loads((side / "config.json").read_text()) if (side / "config.json").is_file() else {}
        extra = {k: original.get(k) for k in TOKEN_IDS}
    hf.save(dst, params, cfg, dtype=dtype, max_shard_bytes=max_shard_bytes, **extra)
    if not isinstance(side, CharTokenizer):
        _copy_side_files(side, dst)
    if not (dst / "generation_config.json").is_file():  # what generate() stops on and pads with
        generation = {k: v for k, v in extra.items() if v is not None}
        (dst / "generation_config.json").write_text(json.dumps(generation, indent=2))


def _convert_to_peft(src: pathlib.Path, dst: pathlib.Path, peft_dir: pathlib.Path, dtype: str, max_shard_bytes: int):
    """A LoRA run -> its base policy as a HF checkpoint (`dst`) + its adapters as a PEFT directory."""
    if not ((src / "checkpoints").is_dir() and (src / "config.json").is_file() and lora_run.is_lora_run(src)):
        raise ConfigError(
            f"--peft-adapter: --from {str(src)!r} is not a LoRA run (a run directory with model.lora.rank > 0); "
            "drop --peft-adapter to export its weights"
        )
    policy = lora_run.run_policy(src)
    tensors = peft_export.peft_tensors(policy.adapters, policy.model_cfg, policy.lcfg.rank)  # fails before writing
    base = jax.tree.map(np.asarray, policy.dense_base())
    side = policy.tokenizer_dir or resolve_policy(lora_run.run_config(src)).tokenizer
    _save_hf(dst, base, policy.model_cfg, side, dtype, max_shard_bytes)
    peft_export.save_adapter(peft_dir, tensors, policy.model_cfg, policy.lcfg, dst)
    return policy.model_cfg


def describe(cfg: ModelConfig) -> str:
    """One phrase for a converted model: its size and shape."""
    shapes = abstract_params(cfg)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    moe = f", {cfg.n_experts} experts" if cfg.n_experts else ""
    return f"{n / 1e6:.2f} M parameters, {cfg.n_layers} layers, d_model {cfg.d_model}, vocab {cfg.vocab_size}{moe}"
