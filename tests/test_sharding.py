"""Mesh presets on 8 fake CPU devices: the real GRPO update step gives the same loss, grad norm and
parameters under every preset as on one device, the parameters really are split, and a mesh or batch
that does not fit the devices is a one-line error naming the field and both numbers.

The 8-device work runs in a subprocess (`python tests/test_sharding.py worker`): XLA_FLAGS must be
set before jax is imported, and pytest has imported it already. The must-fail `jaxrl train` runs go
through the CLI's `main` in that same child, after the presets (a child each cost an interpreter
start and a JAX import for one line of stderr).
"""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from conftest import DEFAULT_CONFIG, REPO, TINY
from harness import child_env

PRESETS = {"single": {}, "data": {}, "fsdp": {}, "fsdp_tensor": {"tensor": 2}, "fsdp_expert": {"expert": 2}}
STEPS = 3


def _worker() -> None:
    import dataclasses

    import jax

    from jaxrl.config import LossConfig, MeshConfig, ModelConfig, OptimConfig
    from jaxrl.losses import make_loss
    from jaxrl.models.transformer import init_params, param_logical_axes
    from jaxrl.sharding import batch_sharding, layout_line, make_mesh, parallel_for, param_shardings, replicated
    from jaxrl.train.state import init_state, make_optimizer, state_shardings
    from jaxrl.train.steps import make_logp_fn, make_update_step

    assert jax.device_count() == 8, jax.devices()
    model_cfg = ModelConfig(
        vocab_size=32, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=32
    )
    B, P, T, G = 16, 6, 5, 4
    rng = np.random.default_rng(0)
    lengths_B = rng.integers(1, T + 1, B)
    batch = {
        "prompt_tokens_BxP": rng.integers(3, 32, (B, P)).astype(np.int32),
        "prompt_mask_BxP": (np.arange(P)[None] >= rng.integers(0, 3, B)[:, None]).astype(np.int32),
        "tokens_BxT": rng.integers(3, 32, (B, T)).astype(np.int32),
        "completion_mask_BxT": (np.arange(T)[None] < lengths_B[:, None]).astype(np.float32),
        "rollout_logp_BxT": -rng.uniform(0.5, 4.0, (B, T)).astype(np.float32),
        "rewards_BxK": rng.integers(0, 2, (B, 2)).astype(np.float32),
        "truncated_B": np.zeros(B, np.float32),
    }
    loss = make_loss(LossConfig(preset="grpo", kl_beta=0.05))
    optimizer = make_optimizer(OptimConfig(learning_rate=3e-2, warmup_steps=0), 10)
    base = jax.tree.map(np.asarray, init_params(model_cfg, jax.random.key(1)))

    def update_fn(parallel):  # what the train loop builds: the logp function and the update share one Parallel
        return make_update_step(
            make_logp_fn(model_cfg, 1.0, prompt_groups=G, logits_chunk=12, parallel=parallel),
            loss,
            optimizer,
            ppo_epochs=1,
            microbatches=2,
            max_new_tokens=T,
            use_ref=True,
            group_size=G,
            parallel=parallel,
        )

    results = {}
    for name, sizes in PRESETS.items():
        mesh, preset = make_mesh(MeshConfig(preset=name, **sizes))
        parallel = parallel_for(mesh, preset)
        rep, rows = replicated(mesh), batch_sharding(mesh, preset)
        param_sh = param_shardings(mesh, preset, param_logical_axes(model_cfg), base)

        def make_state(params, ref):
            return init_state(params, optimizer, jax.random.key(0), ref_params=ref)

        state_sh = state_shardings(optimizer, jax.eval_shape(make_state, base, base), param_sh, rep)
        state = jax.jit(make_state, in_shardings=(param_sh, param_sh), out_shardings=state_sh)(base, base)
        update = update_fn(parallel)
        step = jax.jit(update, in_shardings=(state_sh, rows), out_shardings=(state_sh, rep), donate_argnums=0)
        losses, norms = [], []
        for _ in range(STEPS):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
            norms.append(float(metrics["grad_norm"]))
        p = state.params
        mu = state.opt_state[1][0].mu  # adamw's first moment, laid out like the params
        results[name] = {
            "loss": losses,
            "grad_norm": norms,
            "kl": float(metrics["kl"]),
            "params": {
                "/".join(str(k.key) for k in path): np.asarray(v).ravel().tolist()
                for path, v in jax.tree_util.tree_flatten_with_path(p)[0]
            },
            "spec": {
                "embedding": str(p["embedding"].sharding.spec),
                "gate": str(p["blocks"]["mlp"]["gate"].sharding.spec),
                "q": str(p["blocks"]["attn"]["q"].sharding.spec),
                "mu_gate": str(mu["blocks"]["mlp"]["gate"].sharding.spec),
            },
            "shard_shape": {
                "embedding": list(p["embedding"].addressable_shards[0].data.shape),
                "gate": list(p["blocks"]["mlp"]["gate"].addressable_shards[0].data.shape),
                "mu_gate": list(mu["blocks"]["mlp"]["gate"].addressable_shards[0].data.shape),
            },
            "n_devices": len(p["embedding"].sharding.device_set),
            "layout": layout_line(mesh, name, param_sh, base),
        }
        if name == "fsdp_tensor":  # a checkpoint of the sharded state restores into the same layout
            results["restored"] = _checkpoint_roundtrip(state)
    # An MoE model under fsdp_expert: experts split over `expert`, their embed dimension over fsdp.
    moe_cfg = dataclasses.replace(model_cfg, n_experts=4, experts_per_token=2)
    mesh, preset = make_mesh(MeshConfig(preset="fsdp_expert", expert=2))
    abstract = jax.eval_shape(lambda: init_params(moe_cfg, jax.random.key(0)))
    moe_sh = param_shardings(mesh, preset, param_logical_axes(moe_cfg), abstract)
    gate_path = [
        path
        for path, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]
        if "gate" in jax.tree_util.keystr(path) and "moe" in jax.tree_util.keystr(path)
    ][0]
    gate_sh = dict(jax.tree_util.tree_flatten_with_path(moe_sh)[0])[gate_path]
    gate = dict(jax.tree_util.tree_flatten_with_path(abstract)[0])[gate_path]
    results["moe_gate"] = {
        "spec": str(gate_sh.spec),
        "shape": list(gate.shape),
        "shard_shape": list(gate_sh.shard_shape(gate.shape)),
    }
    results["errors"] = {
        "mesh": _train_error("mesh.preset=fsdp_tensor", "mesh.tensor=3"),
        "batch": _train_error("mesh.preset=data", "rollout.group_size=3"),
    }
    print("RESULT " + json.dumps(results))


def _train_error(*sets: str) -> dict:
    """`jaxrl train` of the tiny default config for one step with SETS, on these 8 devices: its exit
    code and everything written to file descriptor 2 meanwhile (Python's and native code's stderr)."""
    import os
    import tempfile

    from jaxrl import cli

    args = [str(DEFAULT_CONFIG), *sum((["--set", t] for t in TINY), []), "--set", "train.steps=1"]
    for s in sets:
        args += ["--set", s]
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile("w+") as err:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            code = cli.main(["train", *args, "--workdir", str(pathlib.Path(tmp) / "run")])
        except BaseException as e:  # reported, so the other results still come back
            code = f"raised {type(e).__name__}: {e}"
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        return {"code": code, "stderr": err.read()}


def _checkpoint_roundtrip(state) -> dict:
    import tempfile

    import jax

    from jaxrl.config import CheckpointConfig
    from jaxrl.train import checkpoint as ckpt

    with tempfile.TemporaryDirectory() as tmp:
        manager = ckpt.make_manager(tmp, CheckpointConfig(async_save=False))
        ckpt.save(manager, 3, state, {"stream": {"epoch": 0, "index": 5}}, force=True)
        manager.wait_until_finished()
        step, restored, host = ckpt.restore_latest(manager, ckpt.abstract_like(state))
        manager.close()
    pairs = list(zip(jax.tree.leaves(state), jax.tree.leaves(restored)))

    def raw(x):
        return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x

    return {
        "step": step,
        "host": host,
        "n_leaves": len(pairs),
        "same_values": all(np.array_equal(raw(a), raw(b)) for a, b in pairs),
        "same_shardings": all(a.sharding.is_equivalent_to(b.sharding, a.ndim) for a, b in pairs),
    }


def _env(cache_env: dict) -> dict:
    return child_env(cache_env, devices=8)


@pytest.fixture(scope="module")
def results(cache_env):
    proc = subprocess.run(
        [sys.executable, __file__, "worker"], env=_env(cache_env), capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in PRESETS if n != "single"])
def test_every_preset_matches_one_device(results, name):
    ref, got = results["single"], results[name]
    np.testing.assert_allclose(got["loss"], ref["loss"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(got["grad_norm"], ref["grad_norm"], atol=1e-4, rtol=1e-4)
    assert abs(got["kl"] - ref["kl"]) < 1e-4
    assert ref["loss"][0] != ref["loss"][-1], "the steps must change the params for the comparison to mean anything"
    for key, value in ref["params"].items():
        np.testing.assert_allclose(got["params"][key], value, atol=1e-4, rtol=0, err_msg=f"{name}: {key}")


@pytest.mark.slow
def test_the_layout_line_names_the_axes_and_the_bytes_per_device(results):
    import re

    def numbers(name):
        line = results[name]["layout"]
        total, per_device, split, n, rows = re.search(
            r"params ([\d.]+) MiB, ([\d.]+) MiB per device \((\d+) of (\d+) arrays split\); each step's rows "
            r"split over (\d+) devices",
            line,
        ).groups()
        return line, float(total), float(per_device), int(split), int(n), int(rows)

    n_floats = sum(len(v) for v in results["single"]["params"].values())
    line, total, per_device, split, n, rows = numbers("data")
    assert line.startswith("jaxrl: mesh.preset=data on 8 devices (data=8); ") and rows == 8
    assert (
        total == per_device == round(4 * n_floats / 2**20, 2) and split == 0 and n == len(results["single"]["params"])
    )
    line, total, per_device, split, _, rows = numbers("fsdp_tensor")
    assert "on 8 devices (fsdp=4, tensor=2)" in line and rows == 4 and split > 0
    assert per_device < total / 4  # every array with an embed dimension is split 4 ways, mlp/heads 2 more
    assert numbers("fsdp_expert")[-1] == 8  # rows over fsdp x expert


@pytest.mark.slow
def test_params_really_are_sharded(results):
    # embedding (vocab=32, embed=32); gate (layers=1, embed=32, mlp=64)
    assert results["single"]["n_devices"] == 1 and results["data"]["n_devices"] == 8
    assert results["data"]["shard_shape"]["embedding"] == [32, 32]  # replicated
    fsdp = results["fsdp"]
    assert fsdp["spec"]["embedding"] == "P(None, 'fsdp')"
    assert fsdp["shard_shape"] == {"embedding": [32, 4], "gate": [1, 4, 64], "mu_gate": [1, 4, 64]}
    tp = results["fsdp_tensor"]  # mesh (fsdp=4, tensor=2)
    assert tp["spec"]["gate"] == "P(None, 'fsdp', 'tensor')"
    assert tp["spec"]["mu_gate"] == tp["spec"]["gate"]
    assert tp["spec"]["q"] == "P(None, 'fsdp', 'tensor', None)"
    assert tp["shard_shape"] == {"embedding": [16, 8], "gate": [1, 8, 32], "mu_gate": [1, 8, 32]}
    ep = results["fsdp_expert"]  # mesh (fsdp=4, expert=2); a dense model has no expert axis
    assert ep["shard_shape"]["embedding"] == [32, 8]
    moe = results["moe_gate"]  # (layers, experts=4, embed=32, mlp=64) over (fsdp=4, expert=2)
    assert moe["spec"] == "P(None, 'expert', 'fsdp', None)"
    assert moe["shard_shape"] == [moe["shape"][0], 2, 8, 64]


@pytest.mark.slow
def test_sharded_checkpoint_restores_into_the_same_layout(results):
    r = results["restored"]
    assert r["step"] == 3 and r["host"] == {"stream": {"epoch": 0, "index": 5}}
    assert r["n_leaves"] > 10 and r["same_values"] and r["same_shardings"]


@pytest.mark.slow
def test_mesh_that_does_not_fit_the_devices_is_a_one_line_error(results):
    r = results["errors"]["mesh"]
    assert r["code"] == 2, r
    assert r["stderr"].strip().splitlines() == [
        "jaxrl: error: mesh.tensor=3 does not divide the 8 devices (mesh.preset='fsdp_tensor' needs devices = "
        "fsdp * tensor)"
    ]


@pytest.mark.slow
def test_batch_that_does_not_divide_is_a_one_line_error(results):
    r = results["errors"]["batch"]
    assert r["code"] == 2, r
    assert r["stderr"].strip().splitlines() == [
        "jaxrl: error: rollout.prompts_per_step*rollout.group_size: batch of 12 rows does not divide over the 8 "
        "devices of mesh axis 'data'"
    ]


def test_mesh_sizes_are_checked_in_the_config():
    from jaxrl.config import ConfigError, MeshConfig

    with pytest.raises(
        ConfigError,
        match=r"^mesh\.tensor: got 2, expected 1 unless mesh.preset='fsdp_tensor' "
        r"\(preset is 'fsdp'\)$",
    ):
        MeshConfig(preset="fsdp", tensor=2).validate()
    with pytest.raises(ConfigError, match=r"^mesh\.preset: got 'tp', expected 'single' or 'data' or"):
        MeshConfig(preset="tp").validate()


def test_batch_axis_comes_from_the_shape_letters():
    from jaxrl.sharding import rows_axis

    assert [
        rows_axis(n) for n in ("tokens_BxT", "advantages_B", "routing_BxSxLxK", "routing_LxBxTxk", "num_steps", "step")
    ] == [0, 0, 0, 1, None, None]


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    sys.path.insert(0, str(REPO))
    _worker()
