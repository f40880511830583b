"""Expert-parallel dropless dispatch (shard_map + all_to_all) on 8 fake CPU devices, in a subprocess
(the device count must be set before jax is imported: harness.child_env): equals the single-device naive loop, outputs
and gradients, with every expert weight really split one expert per device; and a tiny MoE model's update steps
under the fsdp_expert preset equal one device's. Both checks run in ONE child: starting a Python that imports
jax and jaxrl on 8 fake devices costs seconds, and nothing here needs two processes."""

import pytest
from harness import child_env, run_python

SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxrl.models import moe, moe_dispatch

assert jax.device_count() == 8
mesh = Mesh(np.array(jax.devices()), ("expert",))
rng = np.random.default_rng(0)
N, D, F, E, K = 64, 8, 16, 8, 2
x = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
ws = [jnp.asarray(rng.normal(size=s) * s[1] ** -0.5, jnp.float32) for s in [(E, D, F), (E, D, F), (E, F, D)]]
# A skewed router: expert 3 is everyone's favourite, so one device receives far more slots than others.
logits = jnp.asarray(rng.normal(size=(N, E)) * 2, jnp.float32).at[:, 3].add(3.0)
gates, experts, _, _ = moe.route(logits, K, "softmax")
assert int(jnp.sum(experts == 3)) > 2 * N * K // E
sharded = [jax.device_put(w, NamedSharding(mesh, PartitionSpec("expert"))) for w in ws]
for w in sharded:
    shapes = {s.data.shape for s in w.addressable_shards}
    assert shapes == {(1,) + w.shape[1:]}, shapes
    assert len({s.device for s in w.addressable_shards}) == 8

ep = jax.jit(lambda x, a, b, c: moe_dispatch.dispatch_expert_parallel(x, a, b, c, experts, gates, mesh))
y = ep(x, *sharded)
want = moe_dispatch.dispatch_naive(x, *ws, experts, gates)
np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
np.testing.assert_allclose(y, moe_dispatch.dispatch_dropless(x, *ws, experts, gates), rtol=1e-5, atol=1e-5)

r = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
g_ep = jax.jit(jax.grad(lambda ws, x: jnp.sum(ep(x, *ws) * r), argnums=(0, 1)))(sharded, x)
g_ref = jax.grad(lambda ws, x: jnp.sum(moe_dispatch.dispatch_naive(x, *ws, experts, gates) * r), argnums=(0, 1))(ws, x)
for a, b in zip(jax.tree.leaves(g_ep), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
assert {s.data.shape for s in g_ep[0][0].addressable_shards} == {(1, D, F)}  # gradients stay expert-sharded
print("dispatch OK", flush=True)
"""


MODEL_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from jaxrl.config import LossConfig, MeshConfig, ModelConfig, OptimConfig
from jaxrl.losses import make_loss
from jaxrl.models.transformer import init_params, param_logical_axes
from jaxrl.sharding import batch_sharding, expert_parallel, make_mesh, param_shardings, replicated
from jaxrl.train.state import init_state, make_optimizer, state_shardings
from jaxrl.train.steps import make_logp_fn, make_update_step

assert jax.device_count() == 8
cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, mlp_dim=32,
                  max_seq_len=16, n_experts=4, experts_per_token=2, moe_dispatch="dropless")
B, P, T, G = 8, 4, 4, 4
rng = np.random.default_rng(0)
batch = {
    "prompt_tokens_BxP": rng.integers(3, 32, (B, P)).astype(np.int32),
    "prompt_mask_BxP": np.ones((B, P), np.int32),
    "tokens_BxT": rng.integers(3, 32, (B, T)).astype(np.int32),
    "completion_mask_BxT": (np.arange(T)[None] < rng.integers(1, T + 1, B)[:, None]).astype(np.float32),
    "rollout_logp_BxT": -rng.uniform(0.5, 4.0, (B, T)).astype(np.float32),
    "rewards_BxK": rng.integers(0, 2, (B, 2)).astype(np.float32),
    "truncated_B": np.zeros(B, np.float32),
}
loss = make_loss(LossConfig(preset="grpo", kl_beta=0.05))
optimizer = make_optimizer(OptimConfig(learning_rate=3e-2, warmup_steps=0), 10)
base = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(1)))

def update_fn(ep):
    return make_update_step(make_logp_fn(cfg, 1.0, expert_parallel=ep), loss, optimizer, ppo_epochs=1,
                            microbatches=1, max_new_tokens=T, use_ref=True, group_size=G)

def run(name, sizes):
    mesh, preset = make_mesh(MeshConfig(preset=name, **sizes))
    ep = expert_parallel(mesh, preset)  # what the train loop gives its update and its rollout
    rep, rows = replicated(mesh), batch_sharding(mesh, preset)
    param_sh = param_shardings(mesh, preset, param_logical_axes(cfg), base)
    make_state = lambda p, r: init_state(p, optimizer, jax.random.key(0), ref_params=r)
    state_sh = state_shardings(optimizer, jax.eval_shape(make_state, base, base), param_sh, rep)
    state = jax.jit(make_state, in_shardings=(param_sh, param_sh), out_shardings=state_sh)(base, base)
    step = jax.jit(update_fn(ep), in_shardings=(state_sh, rows), out_shardings=(state_sh, rep))
    lowered = step.lower(state, batch)  # no context mesh: the spec alone says where the experts go
    hlo = lowered.compile().as_text()
    if ep is not None:  # an ambient mesh no longer makes a layer built without the spec expert-parallel
        assert "all_to_all" in lowered.as_text()
        plain = jax.jit(update_fn(None), in_shardings=(state_sh, rows), out_shardings=(state_sh, rep))
        with jax.set_mesh(mesh):
            assert "all_to_all" not in plain.lower(state, batch).as_text()
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch)
        losses += [float(metrics["loss"]), float(metrics["grad_norm"])]
    return losses, jax.tree.map(np.asarray, state.params), hlo

assert expert_parallel(*make_mesh(MeshConfig(preset="fsdp_expert", expert=1))) is None  # an axis of 1: one device
ref_loss, ref_params, ref_hlo = run("single", {})
assert "all-to-all" not in ref_hlo
got_loss, got_params, hlo = run("fsdp_expert", {"expert": 4})  # mesh (fsdp=2, expert=4): one expert a device
assert "all-to-all" in hlo
assert ref_loss[0] != ref_loss[-2]
np.testing.assert_allclose(got_loss, ref_loss, atol=1e-4, rtol=0)  # loss and grad norm of each of 3 steps
# Adam turns summation-order noise in a near-zero gradient into a visible step: params get a 0.5% margin.
for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=5e-3)
print("losses, grad norms", got_loss, flush=True)
print("model OK", flush=True)
"""

ROLLOUT_SCRIPT = r"""
import types
from jaxrl.config import Config, DataConfig, RolloutConfig
from jaxrl.rollout.sampler import sample
from jaxrl.train.rollout_source import SamplerSource

# The train loop's rollout (SamplerSource) under fsdp_expert, no context mesh anywhere: it takes the same
# expert axis as the update above, so its MoE layers are expert-parallel too, and it draws what one device draws.
n_prompts, G2 = 8, 2
rollout_cfg = RolloutConfig(group_size=G2, prompts_per_step=n_prompts, max_new_tokens=T)
run_cfg = Config(data=DataConfig(max_prompt_len=P), rollout=rollout_cfg)
prompt_NxP = rng.integers(3, 32, (n_prompts, P)).astype(np.int32)
pmask_NxP = (np.arange(P)[None] >= rng.integers(0, 2, n_prompts)[:, None]).astype(np.int32)
key = jax.random.key(5)
tok = types.SimpleNamespace(pad_id=0, eos_id=2)
want = sample(base, cfg, prompt_NxP, pmask_NxP, key, group_size=G2, max_new_tokens=T, temperature=1.0, eos_id=2,
              pad_id=0)
mesh, preset = make_mesh(MeshConfig(preset="fsdp_expert", expert=4))
param_sh = param_shardings(mesh, preset, param_logical_axes(cfg), base)
params = jax.device_put(base, param_sh)
source = SamplerSource(run_cfg, cfg, tok, mesh, preset, param_sh, params, key, {}, None)
assert "all_to_all" in source._rollout.lower(params, prompt_NxP, pmask_NxP, key, {}).as_text()
got, _ = source.produce(params, prompt_NxP, pmask_NxP, key, 1)
np.testing.assert_array_equal(got.tokens_BxT, want.tokens_BxT)
np.testing.assert_array_equal(np.asarray(got.routing_BxSxLxK), want.routing_BxSxLxK)
np.testing.assert_allclose(got.logp_BxT, want.logp_BxT, atol=1e-5, rtol=0)
assert got.completion_mask_BxT.sum() > n_prompts * G2  # rows drew more than one token: decode steps ran
print("rollout OK")
"""


@pytest.mark.slow
def test_expert_parallel_dispatch_and_moe_model_under_fsdp_expert_on_8_fake_devices():
    """SCRIPT: the dispatch alone. MODEL_SCRIPT: a tiny MoE model's update steps under the fsdp_expert
    preset (expert=4 of 8 fake devices), given the preset's expert axis explicitly (no context mesh):
    dropless dispatch becomes expert-parallel (an all-to-all in the compiled step) and the losses and
    parameters equal one device's; a context mesh alone (`jax.set_mesh`) no longer changes the layer.
    ROLLOUT_SCRIPT: the loop's rollout under the same preset gets the same axis, is expert-parallel too,
    and draws one device's tokens, routing and log-probs."""
    proc = run_python(["-c", SCRIPT + MODEL_SCRIPT + ROLLOUT_SCRIPT], child_env(devices=8), check=False)
    out = proc.stdout.splitlines()
    assert proc.returncode == 0 and "dispatch OK" in out and "model OK" in out and out[-1] == "rollout OK", (
        proc.stdout[-2000:] + proc.stderr[-3000:]
    )
