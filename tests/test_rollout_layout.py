"""A rollout layout of its own (`rollout.mesh`): decode under another layout than training's.

In process: the config's one-line errors naming `rollout.mesh.*`. In one child with 8 fake CPU devices
(`python tests/test_rollout_layout.py worker`), training under `fsdp` and the rollout under (a) training's
layout, (b) `data` (params replicated) and (c) `fsdp_tensor` with tensor=2: the policy resharded once by
the loop's `policy_for` lies in the rollout's shardings; the static sampler (`SamplerSource`, top_k=1) and
the slot engine (greedy) draw the same tokens under all three; `jaxrl plan`'s engine chunk, compiled under
the rollout's layout, holds a fraction of the shared layout's temporaries and gathers fewer arrays, and
reports the copy's bytes; a tensor size that does not divide the devices is an error naming
rollout.mesh.tensor; and a two-step `jaxrl train` with rollout.mesh.preset=data runs end to end.
"""

import json
import sys

import pytest
from conftest import DEFAULT_CONFIG, TINY
from harness import worker_result

from jaxrl.config import ConfigError, load_config

BASE = [
    *TINY,
    "model.n_kv_heads=2",
    "mesh.preset=fsdp",
    "mesh.allow_replicated=embedding",
    "rollout.prompts_per_step=8",
    "rollout.group_size=2",
]


def _worker() -> None:  # noqa: PLR0915 (one script: the checks share their setup)
    import dataclasses
    import io
    import pathlib
    import tempfile
    import types
    from contextlib import redirect_stdout

    import jax
    import numpy as np

    from jaxrl import cli
    from jaxrl.config import RolloutMeshConfig
    from jaxrl.models.transformer import init_params
    from jaxrl.policy.resolve import resolve_policy, shardings_for
    from jaxrl.rollout.engine.driver import Engine
    from jaxrl.sharding import make_mesh, parallel_for, rollout_mesh
    from jaxrl.sources.sampler import SamplerSource
    from jaxrl.train.plan import plan
    from jaxrl.train.programs import policy_for, rollout_layout

    assert jax.device_count() == 8
    out: dict = {}
    tmp = pathlib.Path(tempfile.mkdtemp())
    cfg = load_config(DEFAULT_CONFIG, [*BASE, "rollout.top_k=1", "rollout.max_new_tokens=6"])
    tokenizer, model_cfg = resolve_policy(cfg)
    mesh, preset = make_mesh(cfg.mesh)
    param_sh = shardings_for(model_cfg, mesh, preset)
    # Seed 1: greedy rows of varied tokens, some ending in EOS (other seeds repeat one token).
    params = jax.device_put(init_params(model_cfg, jax.random.key(1)), param_sh)
    rng = np.random.default_rng(0)
    P, n = cfg.data.max_prompt_len, cfg.rollout.prompts_per_step
    prompt_NxP = rng.integers(3, model_cfg.vocab_size, (n, P)).astype(np.int32)
    pmask_NxP = (np.arange(P)[None] >= rng.integers(0, P - 2, n)[:, None]).astype(np.int32)
    items = [(i, prompt_NxP[i][pmask_NxP[i] > 0]) for i in range(n)]
    key = jax.random.key(3)
    for name, rm in (
        ("shared", RolloutMeshConfig()),
        ("data", RolloutMeshConfig("data")),
        ("tensor", RolloutMeshConfig("fsdp_tensor", tensor=2)),
    ):
        vcfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, mesh=rm))
        own = rollout_layout(vcfg, model_cfg, mesh)
        unused = None  # the state's shardings: read only under LoRA
        policy = policy_for(None, unused, param_sh, own)(types.SimpleNamespace(params=params))  # pyright: ignore[reportArgumentType]
        r_mesh, r_preset, r_sh = (mesh, preset, param_sh) if own is None else own[:3]
        same = [p.sharding == s for p, s in zip(jax.tree.leaves(policy), jax.tree.leaves(r_sh))]
        source = SamplerSource(vcfg, model_cfg, tokenizer, r_mesh, r_preset, r_sh, policy, key, {}, tmp)
        rollout, _ = source.produce(policy, prompt_NxP, pmask_NxP, key, 1)
        engine = Engine.from_config(
            dataclasses.replace(vcfg, model=model_cfg),
            prompt_len=P,
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
            rng=key,
            greedy=True,
            parallel=parallel_for(r_mesh, r_preset),
        )
        groups = sorted(engine.collect(policy, 0, items, n_groups=n), key=lambda g: g.tag)
        (chunk,) = plan(vcfg, ("engine_chunk",))
        out[name] = {
            "own": own is not None,
            "policy_in_rollout_layout": all(same),
            "mesh": dict(r_mesh.shape),
            "sampler_tokens": rollout.tokens_BxT.tolist(),
            "sampler_logp": rollout.logp_BxT.tolist(),
            "sampler_mask_sum": float(rollout.completion_mask_BxT.sum()),
            "engine_tokens": np.concatenate([g.tokens_GxT for g in groups]).tolist(),
            "chunk": chunk,
        }
    try:
        bad = dataclasses.replace(
            cfg, rollout=dataclasses.replace(cfg.rollout, mesh=RolloutMeshConfig("fsdp_tensor", 3))
        )
        rollout_mesh(bad, mesh)
        out["bad_tensor"] = None
    except ConfigError as e:
        out["bad_tensor"] = str(e)
    # The loop end to end: fsdp training, data-parallel rollout and evaluation, two steps.
    import os

    os.environ["JAXRL_CACHE_DIR"] = str(tmp / "cache")
    os.environ["JAXRL_DATA_DIR"] = str(tmp / "data")
    args = ["train", str(DEFAULT_CONFIG), *[a for t in BASE for a in ("--set", t)], "--workdir", str(tmp / "run")]
    args += ["--set", "train.steps=2", "--set", "train.eval_every=2", "--set", "rollout.mesh.preset=data"]
    with redirect_stdout(io.StringIO()):
        code = cli.main(args)
    rows = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    out["train"] = {"code": code, "steps": [r["step"] for r in rows], "eval": [r.get("eval/accuracy") for r in rows]}
    print("RESULT " + json.dumps(out))


@pytest.fixture(scope="module")
def results(cache_env):
    result, stderr = worker_result(__file__, cache_env, timeout=600)
    return result | {"stderr": stderr}


@pytest.mark.slow
def test_the_policy_is_resharded_into_the_rollout_layout(results):
    assert not results["shared"]["own"] and results["shared"]["mesh"] == {"fsdp": 8}
    assert results["data"]["own"] and results["data"]["mesh"] == {"data": 8}
    assert results["tensor"]["own"] and results["tensor"]["mesh"] == {"fsdp": 4, "tensor": 2}
    assert all(results[v]["policy_in_rollout_layout"] for v in ("shared", "data", "tensor"))


@pytest.mark.slow
def test_tokens_equal_the_shared_layouts(results):
    shared = results["shared"]
    assert shared["sampler_mask_sum"] > 2 * len(shared["sampler_tokens"])  # rows decoded several tokens
    assert len({t for row in shared["sampler_tokens"] for t in row}) > 4  # not one token repeated
    for v in ("data", "tensor"):
        assert results[v]["sampler_tokens"] == shared["sampler_tokens"], v
        assert results[v]["engine_tokens"] == shared["engine_tokens"], v
        got, want = results[v]["sampler_logp"], shared["sampler_logp"]
        assert max(abs(a - b) for ga, wa in zip(got, want) for a, b in zip(ga, wa)) < 1e-4, v


@pytest.mark.slow
def test_the_engine_chunk_under_the_rollout_layout_holds_less(results):
    """The compiled chunk (memory_analysis, HLO text via `jaxrl plan`): fsdp decode keeps the weights
    split and reduces every layer's activations across devices; data-parallel decode has no such
    reductions and holds a fraction of the temporaries; tensor-parallel decode holds fewer than fsdp's.
    The records report the resharded copy's bytes."""
    shared, data, tensor = (results[v]["chunk"] for v in ("shared", "data", "tensor"))
    assert shared["mesh"] == {"preset": "fsdp", "fsdp": 8} and data["mesh"] == {"preset": "data", "data": 8}
    assert data["collectives"]["all-reduce"] < shared["collectives"]["all-reduce"] / 2  # no per-layer reductions
    assert data["memory_mib"]["temp"] < shared["memory_mib"]["temp"] / 2, (data["memory_mib"], shared["memory_mib"])
    assert tensor["memory_mib"]["temp"] < shared["memory_mib"]["temp"], (tensor["memory_mib"], shared["memory_mib"])
    assert "rollout_copy_mib_per_device" not in shared
    # data: the whole params on each device; tensor: split 2 ways (mlp/heads/vocab) and 4 (embed)
    assert data["rollout_copy_mib_per_device"] > 2 * tensor["rollout_copy_mib_per_device"] > 0


@pytest.mark.slow
def test_a_tensor_size_that_does_not_divide_names_the_field(results):
    assert results["bad_tensor"].startswith("rollout.mesh.tensor=3 does not divide the 8 devices")


@pytest.mark.slow
def test_train_runs_with_a_rollout_layout(results):
    assert results["train"]["code"] == 0, results["stderr"][-2000:]
    assert results["train"]["steps"] == [0, 1, 2] and results["train"]["eval"][-1] is not None
    assert "jaxrl: rollout.mesh.preset=data on 8 devices (data=8)" in results["stderr"]


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.mesh.preset=tensor", "rollout.mesh.preset: got 'tensor', expected '' (training's layout), 'data'"),
        ("rollout.mesh.tensor=2", "rollout.mesh.tensor: got 2, expected 1 unless rollout.mesh.preset='fsdp_tensor'"),
        ("rollout.mesh.preset=fsdp_expert", "rollout.mesh.preset: got 'fsdp_expert', expected ''"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_field(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT_CONFIG, [*BASE, override])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("training", ["mesh.preset=single", "mesh.preset=fsdp_expert"])
def test_a_rollout_layout_needs_a_training_mesh_it_can_share(training):
    with pytest.raises(ConfigError, match=r"^rollout.mesh.preset: got 'data', expected '' with mesh.preset="):
        load_config(DEFAULT_CONFIG, [*BASE, training, "rollout.mesh.preset=data"])


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    _worker()
