"""`transformer.rollout_params`: the rollout's weights cast to the compute dtype once per policy version.

Every leaf it casts is one that every forward reads only after `.astype(cfg.dtype)`, so a bfloat16
rollout from cast params is bitwise today's rollout from the float32 masters (static sampler greedy
and sampled, MoE, the slot engine, the trainer's `token_logprobs`), while the compiled sampler's
weight arguments take half the bytes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine import CFG, LENGTHS, MOE, PAD, G, P, T, _items, _params, _prompts

from jaxrl.config import EngineConfig, ModelConfig
from jaxrl.models import transformer as tf
from jaxrl.models.decode import layer_params
from jaxrl.rollout.engine import driver
from jaxrl.rollout.engine.driver import Engine
from jaxrl.rollout.engine.groups import batch_of_groups
from jaxrl.rollout.sampler import SamplingParams, sample

BF16 = dataclasses.replace(CFG, dtype="bfloat16")
BF16_MOE = dataclasses.replace(MOE, dtype="bfloat16")
EOS = CFG.vocab_size  # never emitted: every row runs T steps


def _sample(params, cfg, greedy: bool, seed: int = 7):
    prompt, mask = _prompts()
    sp = SamplingParams(max_new_tokens=T, temperature=1.0, eos_id=EOS, pad_id=PAD, greedy=greedy)
    key = jax.random.PRNGKey(seed)
    out = sample(params, cfg, jnp.asarray(prompt), jnp.asarray(mask), key, sampling=sp, group_size=G)
    return jax.device_get(out)


def _assert_same(a, b):
    for name in ("tokens_BxT", "completion_mask_BxT", "logp_BxT", "finished_B", "routing_BxSxLxK"):
        x, y = getattr(a, name), getattr(b, name)
        if x is None:
            assert y is None, name
            continue
        np.testing.assert_array_equal(x, y, err_msg=name)


def test_casts_only_leaves_read_through_astype():
    """Every MoE / Qwen feature on: norm scales and routers stay float32, everything else is bfloat16;
    a float32 model's params come back as the same object (no copy)."""
    full = ModelConfig(
        vocab_size=16, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64, n_experts=4,
        experts_per_token=2, moe_every=2, dense_tail_layers=1, n_shared_experts=1, shared_expert_gate=True,
        qkv_bias=True, qk_norm=True, tie_embeddings=False,
    )  # fmt: skip
    params = tf.abstract_params(full)
    assert tf.rollout_params(params, full) is params
    cast = jax.eval_shape(lambda p: tf.rollout_params(p, dataclasses.replace(full, dtype="bfloat16")), params)
    kept = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(cast):
        name = jax.tree_util.keystr(path)
        if path[-1].key in ("scale", "router"):
            kept.append(name)
            assert leaf.dtype == jnp.float32, name
        else:
            assert leaf.dtype == jnp.bfloat16, name
    assert len(kept) == 14  # 3 layers x (2 norms + q/k norms) + final norm + 1 router
    with pytest.raises(ValueError, match=r"\['extra'\]"):
        tf.rollout_params({**_params(), "extra": jnp.zeros(3)}, BF16)


@pytest.mark.parametrize("greedy", [True, False])
def test_static_sampler_bitwise_with_cast_params(greedy):
    """bfloat16 decoding from cast params = decoding from the float32 masters, token and log-prob."""
    params = _params()
    cast = tf.rollout_params(params, BF16)
    assert cast["embedding"].dtype == jnp.bfloat16
    _assert_same(_sample(params, BF16, greedy), _sample(cast, BF16, greedy))


def test_moe_sampler_bitwise_with_cast_params():
    """MoE: the float32 router picks the same experts (recorded routing equal), sampled tokens equal."""
    params = _params(MOE)
    a, b = _sample(params, BF16_MOE, greedy=False), _sample(tf.rollout_params(params, BF16_MOE), BF16_MOE, False)
    assert a.routing_BxSxLxK is not None
    _assert_same(a, b)


def test_trainer_logprobs_unchanged_by_cast():
    """The update keeps float32 masters; its `token_logprobs` equals the same forward on cast params
    (rollout-vs-trainer gaps are today's: the sampler's side is bitwise today's by the tests above)."""
    params = _params()
    out = _sample(tf.rollout_params(params, BF16), BF16, greedy=False)
    prompt, mask = _prompts()
    args = (np.repeat(prompt, G, 0), np.repeat(mask, G, 0), out.tokens_BxT, out.completion_mask_BxT, 1.0)
    master, _ = tf.token_logprobs(params, BF16, *args)
    on_cast, _ = tf.token_logprobs(tf.rollout_params(params, BF16), BF16, *args)
    np.testing.assert_array_equal(np.asarray(master), np.asarray(on_cast))


def _collect(monkeypatch, split):
    monkeypatch.setattr(driver, "split_params", split)
    ecfg = EngineConfig(enabled=True, slots=3, chunk=2)
    sp = SamplingParams(max_new_tokens=T, temperature=1.0, eos_id=EOS, pad_id=PAD, greedy=False)
    engine = Engine(BF16, ecfg, group_size=G, prompt_len=P, sampling=sp, rng=jax.random.PRNGKey(3))
    groups = sorted(engine.collect(_params(), 0, _items(), n_groups=len(LENGTHS)), key=lambda g: g.tag)
    return batch_of_groups(groups).fields()


def test_engine_bitwise_with_cast_split(monkeypatch):
    """The slot engine's `split_params` now casts; its sampled rollout equals today's (uncast split)."""
    lparams = driver.split_params(_params(), BF16)
    assert lparams["blocks"][0]["mlp"]["up"].dtype == jnp.bfloat16
    assert lparams["blocks"][0]["mlp_norm"]["scale"].dtype == jnp.float32
    new = _collect(monkeypatch, driver.split_params)
    old = _collect(monkeypatch, jax.jit(layer_params, static_argnames="cfg"))
    assert new.keys() == old.keys()
    for name in new:
        np.testing.assert_array_equal(new[name], old[name], err_msg=name)


def test_sampler_weight_arguments_halve():
    """Compile-only: the jitted sampler's argument bytes drop by exactly half the cast leaves' float32
    bytes (the weights it reads per decode step), the float32-kept norm scales unchanged."""
    params = _params()
    cast = tf.rollout_params(params, BF16)
    prompt, mask = _prompts()
    sp = SamplingParams(max_new_tokens=T, temperature=1.0, eos_id=EOS, pad_id=PAD, greedy=True)

    def arg_bytes(p):
        fn = jax.jit(lambda p, x, m, k: sample(p, BF16, x, m, k, sampling=sp, group_size=G))
        mem = fn.lower(p, jnp.asarray(prompt), jnp.asarray(mask), jax.random.PRNGKey(0)).compile().memory_analysis()
        assert mem is not None
        return mem.argument_size_in_bytes

    def nbytes(tree, keep):
        return sum(x.nbytes for path, x in jax.tree_util.tree_leaves_with_path(tree) if keep(path[-1].key))

    def is_cast(key):
        return key not in ("scale", "router")

    f32_weights, bf16_weights = nbytes(params, is_cast), nbytes(cast, is_cast)
    assert bf16_weights * 2 == f32_weights
    assert nbytes(params, lambda k: not is_cast(k)) == nbytes(cast, lambda k: not is_cast(k))
    assert arg_bytes(params) - arg_bytes(cast) == f32_weights - bf16_weights
