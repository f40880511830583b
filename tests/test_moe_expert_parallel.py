"""Expert-parallel dropless dispatch (shard_map + all_to_all) on 8 fake CPU devices, in a subprocess
(the device count must be set before jax is imported: harness.child_env): equals the single-device naive loop,
outputs and gradients, with every expert weight really split one expert per device; and a tiny MoE model's update
steps and rollouts (plain, speculative, slot engine) under the fsdp_expert preset equal one device's. All checks run
in ONE child: starting a Python that imports jax and jaxrl on 8 fake devices costs seconds, and nothing here needs
two processes."""

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

# Padding: a token that is not live is sent nowhere and computed by no expert, also when routing replay gives
# it expert 0 (the recorded routing of a padding slot): the rows the devices receive are exactly the live
# token-slots (before: all 8 x 128 buffer rows went through the experts, the empty ones to expert 0).
mask = jnp.asarray(rng.random(N) < 0.6)
replay = jnp.where(mask[:, None], experts, 0)
for gmm in ("ragged", "blocked"):
    for ids in (experts, replay):
        def counted(x, a, b, c):
            args = (x, a, b, c, ids, gates, mesh, "expert", gmm)
            return moe_dispatch.dispatch_expert_parallel_counted(*args, mask_N=mask)
        y_m, received = jax.jit(counted)(x, *sharded)
        assert received.shape == (8,) and int(received.sum()) == int(mask.sum()) * K, (gmm, received)
        want_m = moe_dispatch.dispatch_naive(x, *ws, ids, gates * mask[:, None])  # 0 on the padding tokens
        np.testing.assert_allclose(y_m, want_m, rtol=1e-5, atol=1e-5)
        assert not np.asarray(y_m)[~np.asarray(mask)].any()
        if gmm == "ragged":
            continue  # the gradients of the blocked form (its hand-written backward) are the ones at risk
        g_m = jax.jit(jax.grad(lambda ws, x: jnp.sum(counted(x, *ws)[0] * r), argnums=(0, 1)))(sharded, x)
        g_want = jax.grad(lambda ws, x: jnp.sum(moe_dispatch.dispatch_naive(x, *ws, ids, gates * mask[:, None]) * r),
                          argnums=(0, 1))(ws, x)
        for a, b in zip(jax.tree.leaves(g_m), jax.tree.leaves(g_want)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    _, received = jax.jit(lambda x, a, b, c: moe_dispatch.dispatch_expert_parallel_counted(
        x, a, b, c, experts, gates, mesh, "expert", gmm))(x, *sharded)
    assert int(received.sum()) == N * K  # no mask: every token is live
print("dispatch OK", flush=True)
"""


MODEL_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from jaxrl.config import LossConfig, MeshConfig, ModelConfig, OptimConfig
from jaxrl.losses import make_loss
from jaxrl.models import moe, moe_dispatch
from jaxrl.models.transformer import init_params, param_logical_axes
from jaxrl.sharding import batch_sharding, make_mesh, parallel_for, param_shardings, replicated
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
    return make_update_step(make_logp_fn(cfg, 1.0, parallel=ep), loss, optimizer, ppo_epochs=1,
                            microbatches=1, max_new_tokens=T, use_ref=True, group_size=G)

def run(name, sizes):
    mesh, preset = make_mesh(MeshConfig(preset=name, **sizes))
    ep = parallel_for(mesh, preset)  # what the train loop gives its update and its rollout
    rep, rows = replicated(mesh), batch_sharding(mesh, preset)
    param_sh = param_shardings(mesh, preset, param_logical_axes(cfg), base)
    make_state = lambda p, r: init_state(p, optimizer, jax.random.key(0), ref_params=r)
    state_sh = state_shardings(optimizer, jax.eval_shape(make_state, base, base), param_sh, rep)
    state = jax.jit(make_state, in_shardings=(param_sh, param_sh), out_shardings=state_sh)(base, base)
    step = jax.jit(update_fn(ep), in_shardings=(state_sh, rows), out_shardings=(state_sh, rep))
    lowered = step.lower(state, batch)  # no context mesh: the spec alone says where the experts go
    hlo = lowered.compile().as_text()
    if ep is not None and ep.expert is not None:  # a context mesh alone makes no layer built without the spec EP
        assert "all_to_all" in lowered.as_text()
        plain = jax.jit(update_fn(None), in_shardings=(state_sh, rows), out_shardings=(state_sh, rep))
        with jax.set_mesh(mesh):
            assert "all_to_all" not in plain.lower(state, batch).as_text()
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch)
        losses += [float(metrics["loss"]), float(metrics["grad_norm"])]
    return losses, jax.tree.map(np.asarray, state.params), hlo

assert parallel_for(*make_mesh(MeshConfig(preset="fsdp_expert", expert=1))).experts is None  # an axis of 1: one device
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

# Routing replay over padding, through the model: left-padded prompts, rows that finished early, and a recorded
# routing of zeros (expert 0) at every padding slot. The expert-parallel forward sends each MoE layer only the
# live tokens (a spy reads each dispatch's received-row count) and gives one device's log-probs on them.
pad_batch = dict(batch, prompt_mask_BxP=(np.arange(P)[None] >= rng.integers(0, 3, B)[:, None]).astype(np.int32))
live_BxS = np.concatenate([pad_batch["prompt_mask_BxP"] > 0, pad_batch["completion_mask_BxT"] > 0], 1)
assert 0 < live_BxS.sum() < live_BxS.size
chosen = np.argsort(rng.random((B, P + T, cfg.n_layers, cfg.n_experts)), -1)[..., : cfg.experts_per_token]
pad_batch["routing_BxSxLxK"] = np.where(live_BxS[:, :, None, None], chosen, 0).astype(np.int32)
received = []
_dispatch = moe.dispatch_expert_parallel
def _counting(*args, **kwargs):
    y, count = moe_dispatch.dispatch_expert_parallel_counted(*args, **kwargs)
    jax.debug.callback(lambda c: received.append(int(np.sum(c))), count)
    return y
moe.dispatch_expert_parallel = _counting
want_logp = make_logp_fn(cfg, 1.0, routing_replay=True)(base, pad_batch)[0]
mesh, preset = make_mesh(MeshConfig(preset="fsdp_expert", expert=4))
sharded_base = jax.device_put(base, param_shardings(mesh, preset, param_logical_axes(cfg), base))
ep_logp_fn = make_logp_fn(cfg, 1.0, routing_replay=True, parallel=parallel_for(mesh, preset))
got_logp = np.asarray(jax.jit(ep_logp_fn)(sharded_base, pad_batch)[0])
jax.effects_barrier()  # the spy's callbacks have run
moe.dispatch_expert_parallel = _dispatch
assert received == [int(live_BxS.sum()) * cfg.experts_per_token] * cfg.n_layers, (received, live_BxS.sum())
live_T = pad_batch["completion_mask_BxT"] > 0
np.testing.assert_allclose(np.asarray(got_logp)[live_T], np.asarray(want_logp)[live_T], atol=1e-5, rtol=0)
print("model OK", flush=True)
"""

ROLLOUT_SCRIPT = r"""
import types
from jaxrl.config import Config, DataConfig, RolloutConfig
from jaxrl.rollout.sampler import SamplingParams, sample
from jaxrl.sources.sampler import SamplerSource

# The train loop's rollout (SamplerSource) under fsdp_expert, no context mesh anywhere: it takes the same
# expert axis as the update above, so its MoE layers are expert-parallel too, and it draws what one device draws.
n_prompts, G2 = 8, 2
rollout_cfg = RolloutConfig(group_size=G2, prompts_per_step=n_prompts, max_new_tokens=T)
run_cfg = Config(data=DataConfig(max_prompt_len=P), rollout=rollout_cfg)
prompt_NxP = rng.integers(3, 32, (n_prompts, P)).astype(np.int32)
pmask_NxP = (np.arange(P)[None] >= rng.integers(0, 2, n_prompts)[:, None]).astype(np.int32)
key = jax.random.key(5)
tok = types.SimpleNamespace(pad_id=0, eos_id=2)
SP = SamplingParams(max_new_tokens=T, temperature=1.0, eos_id=2, pad_id=0)
want = sample(base, cfg, prompt_NxP, pmask_NxP, key, group_size=G2, sampling=SP)
mesh, preset = make_mesh(MeshConfig(preset="fsdp_expert", expert=4))
param_sh = param_shardings(mesh, preset, param_logical_axes(cfg), base)
params = jax.device_put(base, param_sh)
source = SamplerSource(run_cfg, cfg, tok, mesh, preset, param_sh, params, key, {}, None)
assert "all_to_all" in source._rollout.lower(params, prompt_NxP, pmask_NxP, key, {}).as_text()
got, _ = source.produce(params, prompt_NxP, pmask_NxP, key, 1)
np.testing.assert_array_equal(got.tokens_BxT, want.tokens_BxT)


def assert_live_routing_equal(got_BxSxLxK, want_BxSxLxK, pmask_BxP, completion_mask_BxT):
    # The recorded routing, compared at the slots of live tokens. Expert-parallel dispatch sends a left-padding
    # token nowhere (its routed output is 0: no live token reads it), so the experts its own hidden state picks
    # in later layers differ from one device's there; they are never used (the update sends that slot nowhere).
    live_BxS = np.concatenate([np.asarray(pmask_BxP) > 0, np.asarray(completion_mask_BxT) > 0], 1)
    assert (~live_BxS).any()
    np.testing.assert_array_equal(np.asarray(got_BxSxLxK)[live_BxS], np.asarray(want_BxSxLxK)[live_BxS])


assert_live_routing_equal(
    got.routing_BxSxLxK, want.routing_BxSxLxK, np.repeat(pmask_NxP, G2, 0), want.completion_mask_BxT
)
np.testing.assert_allclose(got.logp_BxT, want.logp_BxT, atol=1e-5, rtol=0)
assert got.completion_mask_BxT.sum() > n_prompts * G2  # rows drew more than one token: decode steps ran
print("rollout OK")
"""

SPEC_SCRIPT = r"""
import dataclasses, inspect
from jaxrl.config import SpeculativeConfig
from jaxrl.models import moe
from jaxrl.rollout.speculative.sample import sample_speculative

# From here on, every MoE layer traced expert-parallel passes through this spy; the functions on the stack
# when it is called say which forward of which path went expert-parallel (a path that lost the axis calls
# one-device dropless dispatch instead, and is missing from the record).
ep_sites = []
_dispatch = moe.dispatch_expert_parallel
def _spy(*args, **kwargs):
    ep_sites.append({f.function for f in inspect.stack()})
    return _dispatch(*args, **kwargs)
moe.dispatch_expert_parallel = _spy
def expect_ep_in(*names):
    missing = [n for n in names if not any(n in s for s in ep_sites)]
    assert not missing, ("not expert-parallel:", missing)
    ep_sites.clear()

# The loop's speculative rollout (SamplerSource, early-exit drafts always taken) under fsdp_expert: the
# prefill, the drafter's and the verify forwards are expert-parallel and it draws what one device draws.
spec = SpeculativeConfig(enabled=True, draft_layers=1, max_draft=3, adaptive=False, calibrate=False)
spec_cfg = Config(data=DataConfig(max_prompt_len=P), rollout=dataclasses.replace(rollout_cfg, speculative=spec))
prior = np.float32(spec.initial_acceptance)
want, want_stats = sample_speculative(
    base, cfg, prompt_NxP, pmask_NxP, key, spec=spec, group_size=G2, sampling=SP,
    acceptance_prior=prior, reuse_acceptance_prior=prior,
)
assert not ep_sites  # one device: nothing expert-parallel
source = SamplerSource(spec_cfg, cfg, tok, mesh, preset, param_sh, params, key, {}, None)
got, metrics = source.produce(params, prompt_NxP, pmask_NxP, key, 1)
expect_ep_in("_prefill_prompts", "_self_draft", "_verify")
assert int(want_stats.self_steps) > 0 and metrics["spec/speculated_frac"] == 1.0, metrics
np.testing.assert_array_equal(got.tokens_BxT, want.tokens_BxT)
assert_live_routing_equal(
    got.routing_BxSxLxK, want.routing_BxSxLxK, np.repeat(pmask_NxP, G2, 0), want.completion_mask_BxT
)
np.testing.assert_allclose(got.logp_BxT, want.logp_BxT, atol=1e-5, rtol=0)
assert metrics["spec/acceptance_estimate"] == float(want_stats.acceptance)
print("speculative OK", flush=True)
"""

ENGINE_SCRIPT = r"""
import functools
from jaxrl.config import EngineConfig
from jaxrl.rollout.engine import partial as engine_partial
from jaxrl.rollout.speculative import engine as engine_speculative
from jaxrl.rollout.engine import state as engine_state
from jaxrl.rollout.episodes import state as episode_state
from jaxrl.rollout.engine.driver import Engine
from jaxrl.rollout.engine.groups import batch_of_groups
from jaxrl.train.evaluate import make_chunk_sampler

# The slot engine, greedy: 6 groups of 2 through 8 slots draw what one device draws.
ep = parallel_for(mesh, preset)
items = [(i, prompt_NxP[i][pmask_NxP[i] > 0]) for i in range(6)]
def run_engine(p, ep):
    engine = Engine(
        cfg, EngineConfig(slots=8, chunk=2, admit_groups=4), group_size=2, prompt_len=P,
        sampling=dataclasses.replace(SP, greedy=True), rng=jax.random.key(3), parallel=ep,
    )
    return engine, batch_of_groups(sorted(engine.collect(p, 0, items, n_groups=6), key=lambda g: g.tag)).fields()

_, want = run_engine(base, None)
assert not ep_sites
engine, got = run_engine(params, ep)
expect_ep_in("_admit", "_decode_step")
for name in ("tokens_BxT", "completion_mask_BxT", "version_BxT"):
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
assert_live_routing_equal(
    got["routing_BxSxLxK"], want["routing_BxSxLxK"], want["prompt_mask_BxP"], want["completion_mask_BxT"]
)
np.testing.assert_allclose(got["rollout_logp_BxT"], want["rollout_logp_BxT"], atol=1e-5, rtol=0)
assert len(got["tokens_BxT"]) == 12 and got["completion_mask_BxT"].sum() > 12  # slots reused; several steps each

# The engine's other kernels, traced only (compiling them on 8 devices costs seconds each; their model
# forwards, `window_layers` and `run_decoder`, are compared with one device's above and in SPEC_SCRIPT):
# speculative tail chunks (4 of 8 slots), episode placement (multi-turn) and re-prefill (partial rollouts).
lparams = engine_state.split_params(params, cfg)
spec_S = engine_speculative.speculative_spec(
    engine.spec, SpeculativeConfig(enabled=True, draft_layers=1, max_draft=3, max_active_rows=4)
)
flat = engine_state.EngineSpec(cfg, 8, P, T, 1, 2, 0, greedy=True, slot_keys=True, parallel=ep)
def blank(spec):
    return jax.eval_shape(functools.partial(engine_state.init_state, spec), key)
R, rows = 4, np.arange(4, dtype=np.int32)
tok_RxT, f_RxT = np.zeros((R, T), np.int32), np.zeros((R, T), np.float32)
traced = [
    engine_speculative.speculative_rows_chunk.trace(lparams, spec_S, blank(spec_S), rows, 2, 0, 1.0),
    episode_state.place.trace(
        params, flat, blank(flat), rows, prompt_NxP[:R], pmask_NxP[:R], tok_RxT, f_RxT, f_RxT, tok_RxT, rows,
        jax.random.split(key, R),
    ),
    engine_partial.reprefill.trace(params, flat, blank(flat), prompt_NxP, pmask_NxP, np.ones(8, bool)),
]
assert all("all_to_all" in str(x.jaxpr) for x in traced)
expect_ep_in("_draft", "_speculative_step", "_history_cache", "reprefill")

# The evaluator's sampler (greedy, its own jit of the sampler) takes the axis too.
sampler = make_chunk_sampler(run_cfg, cfg, tok, group_size=1, greedy=True, parallel=ep)
assert "all_to_all" in str(sampler.trace(params, prompt_BxP=prompt_NxP, prompt_mask_BxP=pmask_NxP, rng=key).jaxpr)
expect_ep_in("shared_step")
print("engine OK", flush=True)
"""


@pytest.mark.slow
def test_expert_parallel_dispatch_and_moe_model_under_fsdp_expert_on_8_fake_devices():
    """SCRIPT: the dispatch alone. MODEL_SCRIPT: a tiny MoE model's update steps under the fsdp_expert
    preset (expert=4 of 8 fake devices), given the preset's expert axis explicitly (no context mesh):
    dropless dispatch becomes expert-parallel (an all-to-all in the compiled step) and the losses and
    parameters equal one device's; a context mesh alone (`jax.set_mesh`) no longer changes the layer.
    ROLLOUT_SCRIPT: the loop's rollout under the same preset gets the same axis, is expert-parallel too,
    and draws one device's tokens, routing and log-probs. SPEC_SCRIPT: the same for the loop's speculative
    rollout (prefill, drafts, verify forwards). ENGINE_SCRIPT: the slot engine (admission, decode steps) is
    expert-parallel and draws one device's tokens; its speculative chunks, episode placement, re-prefill and
    the evaluator's sampler trace expert-parallel forwards (a spy on the dispatch names each call site)."""
    scripts = SCRIPT + MODEL_SCRIPT + ROLLOUT_SCRIPT + SPEC_SCRIPT + ENGINE_SCRIPT
    proc = run_python(["-c", scripts], child_env(devices=8), check=False)
    out = proc.stdout.splitlines()
    done = ("dispatch OK", "model OK", "rollout OK", "speculative OK")
    assert proc.returncode == 0 and all(d in out for d in done) and out[-1] == "engine OK", (
        proc.stdout[-2000:] + proc.stderr[-3000:]
    )
