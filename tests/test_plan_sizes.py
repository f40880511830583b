"""benchmarks/plan_sizes.py: its `jaxrl plan` commands parse, load the GSM8K recipe with the Qwen shapes,
and those shapes have the published parameter counts (abstract shapes only: nothing is compiled)."""

import importlib.util
import math
import shlex

import jax
import pytest
from conftest import REPO

from jaxrl.cli import build_parser
from jaxrl.config import load_config
from jaxrl.models.transformer import abstract_params

_spec = importlib.util.spec_from_file_location("plan_sizes", REPO / "benchmarks" / "plan_sizes.py")
assert _spec is not None and _spec.loader is not None
plan_sizes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_sizes)

# Total parameters as the model cards give them (Qwen2.5 report, Qwen3 model card), to 3 figures.
PUBLISHED = {"qwen2.5-0.5b": 0.494e9, "qwen2.5-1.5b": 1.54e9, "qwen2.5-7b": 7.62e9, "qwen3-30b-a3b": 30.5e9}


def _loaded(model: str, devices: int):
    argv = plan_sizes.command(model, devices)
    args = build_parser().parse_args(argv[1:])
    assert args.command == "plan" and args.devices == devices
    return load_config(REPO / args.config, args.overrides)


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_shapes_have_the_published_parameter_counts(model):
    cfg = _loaded(model, 8)
    assert cfg.model.hf_path == "" and cfg.model.dtype == "bfloat16" and cfg.mesh.preset == "fsdp"
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params(cfg.model)))
    assert n == pytest.approx(PUBLISHED[model], rel=0.01), n


def test_microbatches_keep_a_row_per_device():
    assert _loaded("qwen2.5-0.5b", 8).train.microbatches == 8  # the recipe's own
    assert _loaded("qwen2.5-0.5b", 64).train.microbatches == 4  # 64 rows each: one per device
    explicit = plan_sizes.command("qwen2.5-0.5b", 64, ("train.microbatches=16",))
    assert shlex.join(explicit).count("train.microbatches=") == 1
