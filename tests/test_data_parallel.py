"""Every mesh preset that splits the batch keeps each device on its own rows, read off the compiled
update (8 fake CPU devices, compile only): per-device FLOPs (XLA's cost analysis) and temporaries
(its memory analysis) within 15% of one device's / 8, under data, fsdp and fsdp_tensor, at 1 and 4
microbatches, with the logits chunked. Without the activation constraints (`models.parallel`) fsdp
ran every row on every device with the contraction split (~5x the temporaries) and microbatches put
each whole microbatch on 8 / n devices (~4x); the numbers are unchanged (test_sharding.py).

The programs are compiled in a child (`python tests/test_data_parallel.py worker`): XLA_FLAGS must
be set before jax is imported. A while loop's body is counted once by the cost analysis, so FLOPs
compare like with like: each preset against one device at the same microbatch count.
"""

import json
import sys

import pytest
from harness import worker_result

PRESETS = {"data": {}, "fsdp": {}, "fsdp_tensor": {"tensor": 2}}
MICROBATCHES = (1, 4)
FORWARDS = (0, 8)  # the one-pass forward, and each group's prompt forwarded once (`prompt_groups`, the default)
TOLERANCE = 1.15


def _worker() -> None:
    import jax
    import jax.numpy as jnp

    from jaxrl.config import LossConfig, MeshConfig, ModelConfig, OptimConfig
    from jaxrl.losses import make_loss
    from jaxrl.models.transformer import abstract_params, param_logical_axes
    from jaxrl.sharding import make_mesh, named_shardings, parallel_for, param_shardings, replicated
    from jaxrl.train.state import init_state, make_optimizer, state_shardings
    from jaxrl.train.steps import make_logp_fn, make_update_step

    assert jax.device_count() == 8, jax.devices()
    # Activations dominate (B*S*mlp >> params), as they do at scale; the head is chunked as train.logits_chunk does.
    cfg = ModelConfig(
        vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=256, max_seq_len=64
    )
    B, P, T = 256, 16, 64
    S = jax.ShapeDtypeStruct
    batch = {
        "prompt_tokens_BxP": S((B, P), jnp.int32),
        "prompt_mask_BxP": S((B, P), jnp.int32),
        "tokens_BxT": S((B, T), jnp.int32),
        "completion_mask_BxT": S((B, T), jnp.float32),
        "rollout_logp_BxT": S((B, T), jnp.float32),
        "rewards_BxK": S((B, 1), jnp.float32),
        "truncated_B": S((B,), jnp.float32),
    }
    loss = make_loss(LossConfig(preset="grpo"))
    optimizer = make_optimizer(OptimConfig(), 10)
    params = abstract_params(cfg)

    def compiled(preset_name: str, sizes: dict, microbatches: int, groups: int, n_devices: int) -> dict:
        mesh, preset = make_mesh(MeshConfig(preset=preset_name, **sizes), jax.devices()[:n_devices])
        parallel = parallel_for(mesh, preset)
        param_sh = param_shardings(mesh, preset, param_logical_axes(cfg), params)
        rep = replicated(mesh)
        state = jax.eval_shape(lambda p: init_state(p, optimizer, jax.random.key(0)), params)
        state_sh = state_shardings(optimizer, state, param_sh, rep)
        logp_fn = make_logp_fn(cfg, 1.0, prompt_groups=groups, logits_chunk=512, parallel=parallel)
        step = make_update_step(
            logp_fn,
            loss,
            optimizer,
            ppo_epochs=1,
            microbatches=microbatches,
            max_new_tokens=T,
            group_size=8,
            parallel=parallel,
        )
        jitted = jax.jit(
            step, in_shardings=(state_sh, named_shardings(mesh, preset, batch)), out_shardings=(state_sh, rep)
        )
        program = jitted.lower(state, batch).compile()
        cost = program.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        return {"flops": cost["flops"], "temp": program.memory_analysis().temp_size_in_bytes}

    out = {}
    for mb in MICROBATCHES:
        for groups in FORWARDS:
            one = compiled("single", {}, mb, groups, 1)
            for name, sizes in PRESETS.items():
                got = compiled(name, sizes, mb, groups, 8)
                out[f"{name}/{mb}/{groups}"] = {k: got[k] / (one[k] / 8) for k in ("flops", "temp")}
    print("RESULT " + json.dumps(out))


@pytest.fixture(scope="module")
def ratios(cache_env):
    return worker_result(__file__, cache_env, timeout=300)[0]


@pytest.mark.slow
@pytest.mark.parametrize("groups", FORWARDS)
@pytest.mark.parametrize("microbatches", MICROBATCHES)
@pytest.mark.parametrize("name", list(PRESETS))
def test_each_device_runs_its_share_of_the_update(ratios, name, microbatches, groups):
    got = ratios[f"{name}/{microbatches}/{groups}"]
    assert got["flops"] <= TOLERANCE, f"{name}, microbatches={microbatches}: per-device FLOPs {got['flops']:.2f}x ideal"
    assert got["temp"] <= TOLERANCE, f"{name}, microbatches={microbatches}: temporaries {got['temp']:.2f}x ideal"
    assert got["flops"] >= 0.85 and got["temp"] >= 0.5, got  # a ratio far below 1: the measurement is broken


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    _worker()
