"""LoRA adapters -> a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) that
`peft.PeftModel.from_pretrained(base, directory)` loads onto the exported base.

PEFT's LoRA linear computes base(x) + (lora_alpha / r) * lora_B(lora_A(x)) with lora_A.weight (r, in)
and lora_B.weight (out, r): the HF weight (out, in) gains scale * B @ A. Ours gains scale * A @ B on the
(in..., out...) layout, where the in and out dims flatten in C order exactly as `hf.py` flattens the
full weight (q: (D, H, Hd) -> (H*Hd, D); o: (H, Hd, D) -> (D, H*Hd)), so one layer's A (in..., r) is
lora_A = A.reshape(-1, r).T and its B (r, out...) is lora_B = B.reshape(r, -1).T. The tensor names are
the HF weight names `hf.sources` gives, ".weight" replaced by ".lora_A.weight" under PEFT's
"base_model.model." prefix. Routed MoE experts are not exported (transformers fuses them into one
parameter, which PEFT's LoRA modules do not target): the merged export covers those runs.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import numpy as np

from jaxrl.config import ConfigError, ModelConfig
from jaxrl.config.lora import LoraConfig
from jaxrl.models import hf, safetensors_io

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel wraps the CausalLM: its state-dict names gain this prefix


def _pairs(adapters: dict, path: tuple = ()):
    """(param path, {"a", "b"}) for every adapted weight of the adapters tree."""
    if set(adapters) == {"a", "b"}:
        yield path, adapters
        return
    for key, node in adapters.items():
        yield from _pairs(node, (*path, key))


def peft_tensors(adapters: dict, model_cfg: ModelConfig, rank: int) -> dict[str, np.ndarray]:
    """{PEFT tensor name: float32 array} of the adapters, one lora_A / lora_B pair per layer."""
    src_tree = hf.sources(model_cfg, hf._abstract(model_cfg))
    out = {}
    for path, pair in _pairs(adapters):
        src = src_tree
        for key in path:
            src = src[key]
        a, b = np.asarray(jax.device_get(pair["a"]), np.float32), np.asarray(jax.device_get(pair["b"]), np.float32)
        for layer, leaf in enumerate(src):  # stacked layers (or MoE groups): one HF module each
            if not isinstance(leaf, hf._Leaf):
                raise ConfigError(
                    f"--peft-adapter: adapters on routed MoE experts ({'/'.join(path)}, model.lora.experts=true) "
                    "have no PEFT form; export the merged weights (--to-hf without --peft-adapter)"
                )
            out_dim, in_dim = hf._hf_shape(leaf.kind, leaf.shape)
            module = PREFIX + leaf.name.removesuffix(".weight")
            lora_a = np.ascontiguousarray(a[layer].reshape(-1, rank).T)
            lora_b = np.ascontiguousarray(b[layer].reshape(rank, -1).T)
            assert lora_a.shape == (rank, in_dim) and lora_b.shape == (out_dim, rank), (module, lora_a.shape)
            out[module + ".lora_A.weight"] = lora_a
            out[module + ".lora_B.weight"] = lora_b
    return out


def target_modules(names: list[str], model_cfg: ModelConfig) -> list[str]:
    """PEFT's target_modules: the short module names (q_proj, ...) on a dense model; on an MoE model the
    full module paths, since a short name would also match modules that carry no adapter there."""
    modules = sorted({n.removeprefix(PREFIX).rsplit(".lora_", 1)[0] for n in names})
    if model_cfg.n_experts:
        return modules
    return sorted({m.rsplit(".", 1)[-1] for m in modules})


def save_adapter(directory, tensors: dict, model_cfg: ModelConfig, lcfg: LoraConfig, base_dir) -> list[str]:
    """Write the PEFT adapter directory: `tensors` (`peft_tensors` of adapters trained with `lcfg`) on the
    HF checkpoint `base_dir`."""
    directory = pathlib.Path(directory)
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(pathlib.Path(base_dir).absolute()),
        "r": lcfg.rank,
        "lora_alpha": lcfg.alpha,
        "lora_dropout": 0.0,
        "target_modules": target_modules(list(tensors), model_cfg),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
    directory.mkdir(parents=True, exist_ok=True)
    safetensors_io.write_file(directory / WEIGHTS, tensors, {"format": "pt"})
    (directory / CONFIG).write_text(json.dumps(config, indent=2))
    return [WEIGHTS, CONFIG]
