"""The critic under a mesh (8 fake CPU devices, in a child: XLA_FLAGS must be set before jax is
imported): the compiled fsdp update takes the critic's trunk (and its Adam moments) split exactly as
the policy's params, and the sharded PPO update (2 microbatches, 2 epochs) gives the one-device
update's policy, critic and metrics up to float rounding."""

import json
import sys

import pytest
from harness import worker_result


def _worker() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jaxrl.config import CriticConfig, LossConfig, MeshConfig, ModelConfig
    from jaxrl.losses import make_loss
    from jaxrl.models.transformer import init_params, param_logical_axes
    from jaxrl.sharding import make_mesh, named_shardings, parallel_for, param_shardings, replicated
    from jaxrl.train import critic as critic_lib
    from jaxrl.train.state import init_state, state_shardings
    from jaxrl.train.steps import make_logp_fn, make_update_step

    assert jax.device_count() == 8, jax.devices()
    cfg = ModelConfig(
        vocab_size=32, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128, max_seq_len=16
    )
    B, P, T = 16, 4, 4
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, T + 1, B)
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    batch = {
        "prompt_tokens_BxP": jnp.asarray(rng.integers(3, 32, (B, P)), jnp.int32),
        "prompt_mask_BxP": jnp.ones((B, P), jnp.int32),
        "tokens_BxT": jnp.asarray(np.where(mask > 0, rng.integers(3, 32, (B, T)), 0), jnp.int32),
        "completion_mask_BxT": jnp.asarray(mask),
        "rewards_BxK": jnp.asarray(rng.integers(0, 2, (B, 1)), jnp.float32),
    }
    loss = make_loss(LossConfig(preset="ppo"))
    # Plain SGD for both: an update linear in the gradient, so the comparison sees the gradients' float
    # rounding (Adam's first step is lr * sign(g), which flips on gradients that are 0 up to rounding).
    optimizer = optax.sgd(0.05)
    cc = CriticConfig(enabled=True)
    c_opt = optax.sgd(0.05)
    params = init_params(cfg, jax.random.PRNGKey(0))

    def run(preset_name: str, n_devices: int):
        mesh, preset = make_mesh(MeshConfig(preset=preset_name), jax.devices()[:n_devices])
        parallel = parallel_for(mesh, preset)
        param_sh = param_shardings(mesh, preset, param_logical_axes(cfg), params)
        rep = replicated(mesh)
        critic = critic_lib.init_critic(params, cfg, cc, c_opt)
        head = {"w_D": jnp.linspace(-0.1, 0.1, cfg.d_model), "b": jnp.asarray(0.2)}
        critic = critic._replace(params=dict(critic.params, head=head))
        state = init_state(params, optimizer, jax.random.key(0))._replace(critic=critic)
        state_sh = state_shardings(optimizer, state, param_sh, rep)
        state_sh = state_sh._replace(critic=critic_lib.critic_shardings(c_opt, critic, param_sh, rep))
        step = make_update_step(
            make_logp_fn(cfg, 1.0, parallel=parallel),
            loss,
            optimizer,
            ppo_epochs=2,
            microbatches=2,
            max_new_tokens=T,
            group_size=1,
            parallel=parallel,
            critic=critic_lib.make_critic_update(cfg, cc, c_opt, microbatches=2, parallel=parallel),
        )
        batch_sh = named_shardings(mesh, preset, batch)
        jitted = jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, rep))
        compiled = jitted.lower(state, batch).compile()
        in_state_sh = compiled.input_shardings[0][0]
        specs = {
            "policy": [str(s.spec) for s in jax.tree.leaves(in_state_sh.params)],
            "trunk": [str(s.spec) for s in jax.tree.leaves(in_state_sh.critic.params["trunk"])],
            "head": [str(s.spec) for s in jax.tree.leaves(in_state_sh.critic.params["head"])],
        }
        new, metrics = jitted(jax.device_put(state, state_sh), jax.device_put(batch, batch_sh))
        return new, metrics, specs

    one, m_one, _ = run("single", 1)
    many, m_many, specs = run("fsdp", 8)

    def diff(a, b):
        pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
        return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in pairs)

    out = {
        "policy_diff": diff(one.params, many.params),
        "critic_diff": diff(one.critic.params, many.critic.params),
        "metric_diff": {k: abs(float(m_one[k]) - float(m_many[k])) for k in m_one},
        "value_loss": float(m_one["critic/value_loss"]),
        "specs": specs,
    }
    print("RESULT " + json.dumps(out))


@pytest.mark.slow
def test_sharded_critic_update_equals_one_device(cache_env):
    got, _ = worker_result(__file__, cache_env, timeout=400)
    specs = got["specs"]
    assert specs["trunk"] == specs["policy"]  # the critic's trunk is laid out by the policy's rules
    assert any("'" in s for s in specs["trunk"]), specs  # and fsdp does split it (a mesh axis is named)
    assert not any("'" in s for s in specs["head"]), specs  # the head is replicated
    assert got["value_loss"] > 0
    assert got["policy_diff"] < 1e-5 and got["critic_diff"] < 1e-5, got
    assert max(got["metric_diff"].values()) < 1e-4, got["metric_diff"]


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    _worker()
