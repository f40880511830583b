"""model.attention: the no-cache / stacked attention kernels by backend against the einsum reference.

"xla" runs here (jax.nn.dot_product_attention, implementation="xla") and is compared with
`attend_slots` forward and backward. "cudnn" cannot run on CPU: it is lowered for CUDA with a
stand-in cuDNN version (JAX asks the installed cuDNN for it at trace time) and the test asserts
that the program holds cuDNN's fused attention calls; its numbers are left to the device check.
"splash" (Pallas TPU splash attention) runs here in Pallas' interpreter, forward and backward,
and is lowered for TPU to assert its three Mosaic kernels; no TPU has run it.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import child_env, run_python

from jaxrl.config import ConfigError, ModelConfig
from jaxrl.models import transformer as tf
from jaxrl.models.attention import allowed_slots, attend, attend_slots, attend_slots_fused, resolve_kernel
from jaxrl.models.cache_kinds import StackedKV
from jaxrl.models.shared_prefix import token_logprobs_shared
from jaxrl.models.splash import _splash_tiles, attend_slots_splash

B, T, S, K, R, HD = 3, 5, 9, 2, 3, 8  # GQA: K kv heads, R query heads each
CFG = ModelConfig(vocab_size=29, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)


def _qkv(seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, K * R, HD)) * HD**-0.5
    k, v = rng.standard_normal((2, B, S, K, HD))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


# Row 0 unpadded, row 1 two left pads, row 2 five (so its first query at slot 4 sees no key at all).
KEY_VALID_BxS = jnp.asarray(np.arange(S)[None, :] >= np.array([0, 2, 5])[:, None])


@pytest.mark.parametrize(("index", "pad"), [(0, False), (4, False), (4, True)])
def test_xla_kernel_matches_einsum_forward_and_gradient(index, pad):
    """Causal from the offset `index` (queries at slots index..index+T-1 of S keys), left padding,
    GQA, float32: outputs and the gradients of q, k, v agree with `attend_slots` to 1e-5. `pad`: the
    odd T and S padded to even as for cuDNN (one dropped query, one masked key) changes no query that
    sees a key; a query that sees none (a pad: nothing reads it) averages over S+1 values instead of
    S, so there the loss leaves it out."""
    q, k, v = _qkv()
    w_BxTxHxHd = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
    sees_BxT = jnp.any(allowed_slots(KEY_VALID_BxS, jnp.int32(index), T, S), axis=-1)
    assert not bool(jnp.all(sees_BxT))  # row 2's first query (slot 4) sees no key
    if pad:
        w_BxTxHxHd = w_BxTxHxHd * sees_BxT[:, :, None, None]

    def loss(kernel, q, k, v):
        if kernel == "cpu":
            o = attend_slots(q, k, v, KEY_VALID_BxS, jnp.int32(index), jnp.float32)
        else:
            o = attend_slots_fused(q, k, v, KEY_VALID_BxS, jnp.int32(index), jnp.float32, kernel, pad_to_even=pad)
        return jnp.sum(o * w_BxTxHxHd), o

    (_, want), want_grads = jax.value_and_grad(lambda *a: loss("cpu", *a), argnums=(0, 1, 2), has_aux=True)(q, k, v)
    (_, got), got_grads = jax.value_and_grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2), has_aux=True)(q, k, v)
    assert got.dtype == jnp.float32 and got.shape == want.shape
    rows = sees_BxT if pad else jnp.ones_like(sees_BxT)
    np.testing.assert_allclose(got[rows], want[rows], rtol=1e-5, atol=1e-5)
    for name, g, w in zip("qkv", got_grads, want_grads):
        assert float(jnp.max(jnp.abs(w))) > 1e-3, name  # the gradient is not trivially zero
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


def test_stacked_cache_kernel_writes_and_matches():
    """Through `attend` with a StackedKV (prefill): the cache is written the same and the output
    matches the cpu kernel."""
    q, k_new, v_new = _qkv(2)
    k_new, v_new = k_new[:, :T], v_new[:, :T]
    L = 2
    zeros = jnp.zeros((L, B, S, K, HD), jnp.float32)
    kv = StackedKV(zeros, zeros + 1.0)
    index, layer = jnp.int32(3), jnp.int32(1)
    outs = {
        kern: attend(q, k_new, v_new, kv, KEY_VALID_BxS, index, layer, jnp.float32, kern) for kern in ("cpu", "xla")
    }
    (o_cpu, kv_cpu), (o_xla, kv_xla) = outs["cpu"], outs["xla"]
    np.testing.assert_allclose(o_xla, o_cpu, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(kv_xla.k_LxBxSxKxHd, kv_cpu.k_LxBxSxKxHd)
    np.testing.assert_array_equal(kv_xla.v_LxBxSxKxHd[1, :, 3 : 3 + T], v_new)


def test_resolve_kernel_by_backend():
    assert resolve_kernel("auto", jnp.float32, 8) == ("cpu" if jax.default_backend() == "cpu" else "xla")
    assert resolve_kernel("auto", jnp.bfloat16, 128, backend="gpu") == "cudnn"
    assert resolve_kernel("auto", jnp.float32, 128, backend="gpu") == "xla"  # cuDNN takes 16-bit only
    assert resolve_kernel("auto", jnp.bfloat16, 100, backend="gpu") == "xla"  # head_dim not a multiple of 8
    assert resolve_kernel("auto", jnp.bfloat16, 128, backend="tpu") == "splash"
    assert resolve_kernel("auto", jnp.float32, 64, backend="tpu") == "splash"
    assert resolve_kernel("auto", jnp.bfloat16, 80, backend="tpu") == "xla"  # head_dim not a multiple of 64
    assert resolve_kernel("cudnn", jnp.bfloat16, 128, backend="cpu") == "cudnn"  # an explicit choice stands
    assert resolve_kernel("splash", jnp.float32, 8, backend="cpu") == "splash"
    with pytest.raises(ValueError, match="model.attention"):
        resolve_kernel("flash", jnp.bfloat16, 128)


def test_config_names_model_attention():
    ModelConfig(attention="xla").validate()
    ModelConfig(attention="cudnn", dtype="bfloat16").validate()
    ModelConfig(attention="splash").validate()
    with pytest.raises(ConfigError, match=r"model\.attention: got 'flash'.*'splash'"):
        ModelConfig(attention="flash").validate()
    with pytest.raises(ConfigError, match=r"model\.attention: got 'cudnn'.*model\.dtype='float32'"):
        ModelConfig(attention="cudnn").validate()
    with pytest.raises(ConfigError, match=r"model\.attention: got 'cudnn'.*model\.head_dim=12"):
        ModelConfig(attention="cudnn", dtype="bfloat16", head_dim=12).validate()


def _logprob_batch(P=6):
    rng = np.random.default_rng(3)
    prompt = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, P)), jnp.int32)
    pmask = jnp.asarray([[1] * P, [0] * 3 + [1] * (P - 3)], jnp.int32)  # row 1 left padded
    comp = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 4)), jnp.int32)
    return prompt, pmask, comp, jnp.ones((2, 4))


def test_model_token_logprobs_equal_under_cpu_and_xla():
    """A tiny model's token_logprobs and their gradient: `auto` on CPU is the cpu kernels bit for bit
    (the same program), `xla` agrees to float32 rounding."""
    params = tf.init_params(CFG, jax.random.PRNGKey(0))
    batch = _logprob_batch()

    def logp(cfg):
        return tf.token_logprobs(params, cfg, *batch, 1.0)[0]

    cpu = logp(dataclasses.replace(CFG, attention="cpu"))
    np.testing.assert_array_equal(logp(CFG), cpu)
    xla_cfg = dataclasses.replace(CFG, attention="xla")
    np.testing.assert_allclose(logp(xla_cfg), cpu, rtol=1e-5, atol=1e-5)
    hlo = tf.token_logprobs.lower(params, xla_cfg, *batch, 1.0).as_text()
    assert hlo != tf.token_logprobs.lower(params, CFG, *batch, 1.0).as_text()  # the option reached the layers

    def grad(cfg):
        return jax.grad(lambda p: jnp.sum(tf.token_logprobs(p, cfg, *batch, 1.0)[0]))(params)

    for g_xla, g_cpu in zip(jax.tree.leaves(grad(xla_cfg)), jax.tree.leaves(grad(CFG))):
        np.testing.assert_allclose(g_xla, g_cpu, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("P", [6, 5])
def test_cudnn_kernel_lowers_for_cuda(monkeypatch, P):
    """Training's forward and backward with attention=cudnn lower for CUDA to cuDNN's fused
    attention calls, also for an odd length S = P + 4 = 9, which cuDNN's training kernel refuses
    unpadded (no GPU here: a stand-in cuDNN version; whether cuDNN accepts the program and its
    numbers are the device check's)."""
    from jax._src.cudnn import fused_attention_stablehlo

    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 90800)
    cfg = dataclasses.replace(CFG, attention="cudnn", dtype="bfloat16")
    params = jax.eval_shape(tf.init_params, cfg, jax.random.PRNGKey(0))
    batch = _logprob_batch(P)

    def lowered(cfg):
        def loss(p):
            return jnp.sum(tf.token_logprobs(p, cfg, *batch, 1.0)[0])

        return jax.jit(jax.grad(loss)).trace(params).lower(lowering_platforms=("cuda",)).as_text()

    text = lowered(cfg)
    assert "__cudnn$fmhaScaleBiasSoftmax(" in text  # forward: fused attention, the mask as a bias
    assert "__cudnn$fmhaScaleBiasSoftmaxBackward(" in text
    # The einsum kernel's float32 B x K x R x T x S scores (S = P + 4) are gone; the cpu kernel has them.
    scores = f"tensor<2x2x2x{P + 4}x{P + 4}xf32>"
    assert scores not in text
    assert scores in lowered(dataclasses.replace(cfg, attention="cpu"))


@pytest.mark.parametrize(
    ("T", "dtype", "tol"),
    [(S, jnp.float32, 1e-5), (T, jnp.float32, 1e-5), (S, jnp.bfloat16, 3e-2)],
    ids=["nocache-f32", "offset4-f32", "nocache-bf16"],
)
def test_splash_kernel_matches_einsum_forward_and_gradient(T, dtype, tol):
    """Splash in Pallas' interpreter against `attend_slots`: T = S queries at offset 0 (the no-cache
    kind) or T = 5 at offset S - T = 4; left padding, GQA; values and the gradients of q, k, v. T and
    S (9) are padded to one 128 tile each. The loss leaves out the queries that see no key (left-pad
    queries: the two kernels average different keys there, both finite), as in the padded xla test."""
    q, k, v = _qkv(4, dtype)
    q = jnp.asarray(np.random.default_rng(5).standard_normal((B, T, K * R, HD)) * HD**-0.5, dtype)
    offset = S - T
    sees_BxT = jnp.any(allowed_slots(KEY_VALID_BxS, jnp.int32(offset), T, S), axis=-1)
    assert not bool(jnp.all(sees_BxT)) and bool(jnp.any(sees_BxT[2]))  # row 2 has queries of both kinds
    w_BxTxHxHd = jnp.asarray(np.random.default_rng(6).standard_normal(q.shape), dtype) * sees_BxT[:, :, None, None]

    def loss(kernel, q, k, v):
        if kernel == "cpu":
            o = attend_slots(q, k, v, KEY_VALID_BxS, jnp.int32(offset), dtype)
        else:
            o = attend_slots_splash(q, k, v, KEY_VALID_BxS, offset, dtype, interpret=True)
        return jnp.sum((o * w_BxTxHxHd).astype(jnp.float32)), o

    grad = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)
    (_, want), want_grads = grad("cpu", q, k, v)
    (_, got), got_grads = grad("splash", q, k, v)
    assert got.dtype == dtype and got.shape == want.shape
    assert bool(jnp.all(jnp.isfinite(got)))  # the queries that see no key too
    f32 = np.float32
    np.testing.assert_allclose(np.asarray(got[sees_BxT], f32), np.asarray(want[sees_BxT], f32), rtol=tol, atol=tol)
    for name, g, w in zip("qkv", got_grads, want_grads):
        assert g.dtype == dtype and float(jnp.max(jnp.abs(w))) > 1e-2, name  # the gradient is not trivially zero
        np.testing.assert_allclose(np.asarray(g, f32), np.asarray(w, f32), rtol=tol, atol=tol, err_msg=f"d{name}")


def test_splash_tiles_pad_under_128():
    """A length is padded to a multiple of 128 (the kernel's need), tiled by the largest block dividing it."""
    assert [_splash_tiles(n) for n in (9, 128, 200, 600, 832, 1000)] == [
        (128, 128),
        (128, 128),
        (256, 256),
        (128, 640),
        (128, 896),
        (512, 1024),
    ]


def test_splash_lowers_for_tpu_to_mosaic_kernels():
    """Off the interpreter, training's forward and backward through splash lower for TPU to its
    three Mosaic kernels (forward, dq, dkv), the key padding as segment ids; whether Mosaic compiles
    them and their speed are the device check's (no TPU here). Qwen-like heads: bf16, head_dim 128."""
    q_BxTxHxHd = jnp.zeros((2, 200, 6, 128), jnp.bfloat16)
    k_BxSxKxHd = jnp.zeros((2, 200, 2, 128), jnp.bfloat16)
    key_valid_BxS = jnp.ones((2, 200), bool)

    def loss(q, k, v):
        o = attend_slots_splash(q, k, v, key_valid_BxS, 0, jnp.bfloat16, interpret=False)
        return jnp.sum(o.astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    text = grad.trace(q_BxTxHxHd, k_BxSxKxHd, k_BxSxKxHd).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("@tpu_custom_call(") == 3
    for kernel in ("fwd_segmented_residuals", "dq_segmented_no_residuals", "dkv_segmented_no_residuals"):
        assert f'kernel_name = "splash_mha_{kernel}"' in text
    # T = S = 200 padded to 256 (two 128 tiles), GQA without repeated keys: K = 2 heads reach the kernel.
    assert "tensor<2x6x256x128xbf16>" in text and "tensor<2x2x256x128xbf16>" in text
    assert "tensor<2x6x200x200xf32>" not in text  # no score tensor outside the kernel


def test_model_token_logprobs_under_splash():
    """A tiny model's token_logprobs and their gradient with attention=splash (interpreted) agree with
    the cpu kernels (left-padded prompt row): the one-pass forward's values, the shared-prefix
    forward's (training's default) values and parameter gradients."""
    params = tf.init_params(CFG, jax.random.PRNGKey(0))
    batch = _logprob_batch()
    splash_cfg = dataclasses.replace(CFG, attention="splash")
    cpu_cfg = dataclasses.replace(CFG, attention="cpu")

    def logp(cfg, p=params):
        return tf.token_logprobs(p, cfg, *batch, 1.0)[0]

    np.testing.assert_allclose(logp(splash_cfg), logp(cpu_cfg), rtol=1e-5, atol=1e-5)
    # The option reached the layers: the einsum's B x K x R x S x S float32 scores (S = 6 + 4) are gone,
    # the interpreter's 128 x 128 tiles of the padded sequence are there.
    scores = "tensor<2x2x2x10x10xf32>"
    assert scores in tf.token_logprobs.lower(params, cpu_cfg, *batch, 1.0).as_text()
    hlo = tf.token_logprobs.lower(params, splash_cfg, *batch, 1.0).as_text()
    assert scores not in hlo and "tensor<128x128xf32>" in hlo

    # The update's default forward (a group's prompt once, then its completions over the prompt's
    # stacked keys at the traced offset P): splash through the query buffer, values and gradients.
    prompt, pmask, comp, _ = batch
    prompt, pmask = jnp.repeat(prompt[1:], 2, axis=0), jnp.repeat(pmask[1:], 2, axis=0)  # one group of 2

    def shared(cfg, p=params):
        return token_logprobs_shared(p, cfg, prompt, pmask, comp, 1.0, group_size=2)[0]

    np.testing.assert_allclose(shared(splash_cfg), shared(cpu_cfg), rtol=1e-5, atol=1e-5)
    grads = [jax.grad(lambda p, cfg=cfg: jnp.sum(shared(cfg, p)))(params) for cfg in (splash_cfg, cpu_cfg)]
    for g_splash, g_cpu in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(g_splash, g_cpu, rtol=1e-4, atol=1e-5)


def test_stacked_cache_splash_at_a_traced_index():
    """A StackedKV (prefill) under splash: queries at a traced index 3 ride in an S-slot buffer; the
    cache is written as by the cpu kernel and every query that sees a key matches it."""
    q, k_new, v_new = _qkv(2)
    zeros = jnp.zeros((2, B, S, K, HD), jnp.float32)
    args = (q, k_new[:, :T], v_new[:, :T], StackedKV(zeros, zeros + 1.0), KEY_VALID_BxS)
    run = jax.jit(attend, static_argnames=("dtype", "kernel"))
    o_splash, kv_splash = run(*args, jnp.int32(3), jnp.int32(1), dtype=jnp.float32, kernel="splash")
    o_cpu, kv_cpu = run(*args, jnp.int32(3), jnp.int32(1), dtype=jnp.float32, kernel="cpu")
    sees_BxT = jnp.any(allowed_slots(KEY_VALID_BxS, jnp.int32(3), T, S), axis=-1)
    assert not bool(jnp.all(sees_BxT))
    assert bool(jnp.all(jnp.isfinite(o_splash)))
    np.testing.assert_allclose(o_splash[sees_BxT], o_cpu[sees_BxT], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(kv_splash.k_LxBxSxKxHd, kv_cpu.k_LxBxSxKxHd)


MESH_SCRIPT = r"""
import dataclasses
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxrl.config import ModelConfig
from jaxrl.models import transformer as tf
from jaxrl.models.splash import KernelLayout, attend_slots_splash
from jaxrl.models.parallel import Parallel

assert jax.device_count() == 8
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tensor"))
CFG = ModelConfig(vocab_size=29, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
params = tf.init_params(CFG, jax.random.PRNGKey(0))
rng = np.random.default_rng(3)
rows = NamedSharding(mesh, P("fsdp"))
pmask = np.arange(6)[None] >= np.array([0, 3, 1, 0])[:, None]  # rows 1 and 2 left padded
batch = [rng.integers(0, 29, (4, 6)), pmask, rng.integers(0, 29, (4, 4)), np.ones((4, 4))]
batch = [jax.device_put(jnp.asarray(x, jnp.float32 if i == 3 else jnp.int32), rows) for i, x in enumerate(batch)]


def loss(p, cfg, parallel):
    return jnp.sum(tf.token_logprobs(p, cfg, *batch, 1.0, parallel=parallel)[0])


want, g_want = jax.value_and_grad(loss)(params, dataclasses.replace(CFG, attention="cpu"), None)
splash_step = jax.jit(jax.value_and_grad(loss), static_argnums=(1, 2))
splash_args = (params, dataclasses.replace(CFG, attention="splash"), Parallel(mesh, "fsdp", None, "tensor"))
got, g_got = splash_step(*splash_args)
assert "sdy.manual_computation" in splash_step.lower(*splash_args).as_text()  # the layers got the layout
np.testing.assert_allclose(got, want, rtol=1e-5)
for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
print("model OK")

split = NamedSharding(mesh, P("fsdp", None, "tensor"))
q = jax.device_put(jnp.zeros((8, 200, 4, 128), jnp.bfloat16), split)
k = jax.device_put(jnp.zeros((8, 200, 2, 128), jnp.bfloat16), split)
key_valid = jax.device_put(jnp.ones((8, 200), bool), rows)


def tpu_text(layout):
    def f(q, k, v):
        o = attend_slots_splash(q, k, v, key_valid, 0, jnp.bfloat16, interpret=False, layout=layout)
        return jnp.sum(o.astype(jnp.float32))

    return jax.jit(jax.grad(f, argnums=(0, 1, 2))).trace(q, k, k).lower(lowering_platforms=("tpu",)).as_text()


try:
    tpu_text(None)
    raise SystemExit("a Mosaic kernel over 8 devices lowered without shard_map")
except NotImplementedError as e:
    assert "cannot be automatically partitioned" in str(e), e
text = tpu_text(KernelLayout(mesh, "fsdp", "tensor"))
assert text.count("@tpu_custom_call(") == 3 and "sdy.manual_computation" in text
# Each device's kernel gets its 8/4 rows and 4/2 query heads, 2/2 kv heads (T = S = 200 padded to 256).
assert "tensor<2x2x256x128xbf16>" in text and "tensor<2x1x256x128xbf16>" in text
print("tpu OK")
"""


@pytest.mark.slow
def test_splash_under_a_mesh_on_8_fake_devices():
    """XLA cannot partition a Mosaic kernel over several devices (lowering for TPU refuses it), so
    splash runs under shard_map by the run's `Parallel` (rows over fsdp, heads over tensor): on a
    4 x 2 mesh a tiny model's token_logprobs and parameter gradients (interpreted) equal one device's
    cpu kernels, and lowered for TPU each device's kernel takes its shard of rows and heads."""
    proc = run_python(["-c", MESH_SCRIPT], child_env(devices=8), check=False)
    assert proc.returncode == 0 and proc.stdout.split() == ["model", "OK", "tpu", "OK"], (
        proc.stdout[-2000:] + proc.stderr[-3000:]
    )
