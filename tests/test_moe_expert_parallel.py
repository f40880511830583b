"""Expert-parallel dropless dispatch (shard_map + all_to_all) on 8 fake CPU devices, in a subprocess
(the device count must be set before jax is imported): equals the single-device naive loop, outputs
and gradients, with every expert weight really split one expert per device."""

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]

SCRIPT = r'''
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxrl.models import moe

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

ep = jax.jit(lambda x, a, b, c: moe.dispatch_expert_parallel(x, a, b, c, experts, gates, mesh))
y = ep(x, *sharded)
want = moe.dispatch_naive(x, *ws, experts, gates)
np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
np.testing.assert_allclose(y, moe.dispatch_dropless(x, *ws, experts, gates), rtol=1e-5, atol=1e-5)

r = jnp.asarray(rng.normal(size=(N, D)), jnp.float32)
g_ep = jax.jit(jax.grad(lambda ws, x: jnp.sum(ep(x, *ws) * r), argnums=(0, 1)))(sharded, x)
g_ref = jax.grad(lambda ws, x: jnp.sum(moe.dispatch_naive(x, *ws, experts, gates) * r), argnums=(0, 1))(ws, x)
for a, b in zip(jax.tree.leaves(g_ep), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
assert {s.data.shape for s in g_ep[0][0].addressable_shards} == {(1, D, F)}  # gradients stay expert-sharded
print("OK")
'''


def test_expert_parallel_dispatch_on_8_fake_devices():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]
