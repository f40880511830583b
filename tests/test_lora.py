"""LoRA as a parameter-tree transform (jaxrl.models.lora): zero adapters leave the policy bit for bit,
the merge equals a naive per-matrix loop, the int8 base stays within half a quantisation step, and
every user mistake in model.lora.* is a one-line error naming the field."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import Config, ConfigError, ModelConfig
from jaxrl.config.load import apply_overrides
from jaxrl.config.lora import LoraConfig
from jaxrl.models import lora
from jaxrl.models.transformer import forward, init_params, param_logical_axes

DENSE = ModelConfig(vocab_size=19, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, mlp_dim=24)
MOE = dataclasses.replace(DENSE, n_layers=2, n_experts=3, moe_every=2, experts_per_token=2, n_shared_experts=1)
LORA = LoraConfig(rank=3, alpha=6.0)


@functools.cache
def _jitted_merge(cfg: ModelConfig, lcfg: LoraConfig):
    logical = param_logical_axes(cfg)
    return jax.jit(lambda params, adapters: lora.merge(params, adapters, lcfg, logical))


def _merge(cfg: ModelConfig, lcfg: LoraConfig, params, adapters):
    """lora.merge as one jitted program per model, shared by the tests (eagerly, every matmul and add
    compiles once per leaf shape)."""
    return _jitted_merge(cfg, lcfg)(params, adapters)


def _setup(cfg: ModelConfig, lcfg: LoraConfig):
    params = init_params(cfg, jax.random.key(0))
    logical = param_logical_axes(cfg)
    return params, logical, lora.init_adapters(params, logical, lcfg, jax.random.key(1))


def _tokens():
    tokens_BxS = jax.random.randint(jax.random.key(2), (2, 7), 0, 19)
    mask_BxS = jnp.ones((2, 7), jnp.int32).at[0, :2].set(0)  # a left-padded row
    return tokens_BxS, mask_BxS


def _paths(tree) -> set[str]:
    return {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _weight_names(adapters) -> set[str]:
    """The names of the weights that carry an adapter ({"a", "b"} sit one level below each)."""
    return {p[-2].key for p, _ in jax.tree_util.tree_flatten_with_path(adapters)[0]}


@pytest.mark.parametrize("cfg,lcfg", [(DENSE, LORA), (MOE, dataclasses.replace(LORA, experts=True))])
def test_zero_adapters_leave_the_logits_bit_identical(cfg, lcfg):
    params, logical, adapters = _setup(cfg, lcfg)
    merged = _merge(cfg, lcfg, params, adapters)
    tokens_BxS, mask_BxS = _tokens()
    np.testing.assert_array_equal(
        forward(merged, cfg, tokens_BxS, mask_BxS), forward(params, cfg, tokens_BxS, mask_BxS)
    )


def test_targets_cover_attention_mlp_and_shared_experts_but_experts_only_when_asked():
    params, logical, adapters = _setup(MOE, LORA)
    assert _weight_names(adapters) == {"q", "k", "v", "o", "gate", "up", "down"}
    flat = _paths(adapters)
    assert any("['shared']['gate']" in p for p in flat)  # shared experts are dense MLPs: adapted
    assert not any("['moe']['moe']['gate']" in p for p in flat)  # routed experts: not unless experts=True
    assert not any("router" in p for p in flat)
    with_experts = lora.init_adapters(params, logical, dataclasses.replace(LORA, experts=True), jax.random.key(1))
    a = with_experts["blocks"]["moe"]["moe"]["gate"]["a"]
    assert a.shape == (1, 3, 16, 3)  # (layers, experts, d_model, rank): one adapter per expert
    only_qv = lora.init_adapters(params, logical, dataclasses.replace(LORA, targets=("q", "v")), jax.random.key(1))
    assert _weight_names(only_qv) == {"q", "v"}


def test_merge_equals_a_naive_loop_over_layers_and_experts():
    lcfg = dataclasses.replace(LORA, experts=True)
    params, logical, adapters = _setup(MOE, lcfg)
    # B = 0 at init hides any mistake in the product: give every B random values.
    rng = np.random.default_rng(3)  # numpy: eager jax.random would compile a sampler per leaf shape
    adapters = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), adapters)
    merged = _merge(MOE, lcfg, params, adapters)
    s = lcfg.alpha / lcfg.rank  # 6 / 3 = 2

    o, ad = params["blocks"]["dense_0"]["attn"]["o"], adapters["blocks"]["dense_0"]["attn"]["o"]
    for layer in range(o.shape[0]):  # o: (heads, head_dim) -> embed; A is (heads, head_dim, r)
        a_IxR = np.asarray(ad["a"][layer]).reshape(-1, 3)
        want = np.asarray(o[layer]) + s * (a_IxR @ np.asarray(ad["b"][layer])).reshape(o.shape[1:])
        np.testing.assert_allclose(merged["blocks"]["dense_0"]["attn"]["o"][layer], want, rtol=1e-5, atol=1e-6)

    q, aq = params["blocks"]["moe"]["attn"]["q"], adapters["blocks"]["moe"]["attn"]["q"]
    want = np.asarray(q[0]) + s * (np.asarray(aq["a"][0]) @ np.asarray(aq["b"][0]).reshape(3, -1)).reshape(q.shape[1:])
    np.testing.assert_allclose(merged["blocks"]["moe"]["attn"]["q"][0], want, rtol=1e-5, atol=1e-6)

    up, au = params["blocks"]["moe"]["moe"]["up"], adapters["blocks"]["moe"]["moe"]["up"]
    for e in range(up.shape[1]):  # (layers, experts, d_model, mlp): each expert its own A @ B
        want = np.asarray(up[0, e]) + s * np.asarray(au["a"][0, e]) @ np.asarray(au["b"][0, e])
        np.testing.assert_allclose(merged["blocks"]["moe"]["moe"]["up"][0, e], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(merged["embedding"], params["embedding"])  # untouched weights stay exact
    np.testing.assert_array_equal(merged["blocks"]["moe"]["moe"]["router"], params["blocks"]["moe"]["moe"]["router"])
    assert lora.merge(params, None, lcfg, logical) is not None  # the reference: the base, adapters off
    np.testing.assert_array_equal(lora.merge(params, None, lcfg, logical)["blocks"]["moe"]["attn"]["q"], q)


def test_adapter_axes_match_the_adapters_and_keep_the_weights_axes():
    params, logical, adapters = _setup(MOE, dataclasses.replace(LORA, experts=True))
    axes = lora.adapter_logical_axes(params, logical, dataclasses.replace(LORA, experts=True))
    flat_axes = dict(
        jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]
    )
    flat = dict(jax.tree_util.tree_flatten_with_path(adapters)[0])
    assert flat.keys() == flat_axes.keys()
    for path, x in flat.items():
        assert len(flat_axes[path]) == x.ndim, jax.tree_util.keystr(path)
    q = axes["blocks"]["moe"]["attn"]["q"]
    assert tuple(q["a"]) == ("layers", "embed", None) and tuple(q["b"]) == ("layers", None, "heads", "head_dim")
    gate = axes["blocks"]["moe"]["moe"]["gate"]
    assert tuple(gate["a"]) == ("layers", "expert", "embed", None) and tuple(gate["b"]) == (
        "layers",
        "expert",
        None,
        "mlp",
    )


def test_one_gradient_step_moves_only_b_first_and_changes_the_policy():
    params, logical, adapters = _setup(DENSE, LORA)
    tokens_BxS, mask_BxS = _tokens()

    def loss(ad):
        return jnp.mean(forward(lora.merge(params, ad, LORA, logical), DENSE, tokens_BxS, mask_BxS) ** 2)

    grads = jax.grad(loss)(adapters)
    q = grads["blocks"]["attn"]["q"]
    assert float(jnp.abs(q["a"]).max()) == 0.0  # dL/dA = dL/dW @ B^T, and B is 0 at the start
    assert float(jnp.abs(q["b"]).max()) > 0.0
    stepped = jax.tree.map(lambda x, g: x - 0.1 * g, adapters, grads)
    assert not np.array_equal(
        forward(_merge(DENSE, LORA, params, stepped), DENSE, tokens_BxS, mask_BxS),
        forward(params, DENSE, tokens_BxS, mask_BxS),
    )


def test_int8_base_is_within_half_a_step_per_output_column():
    lcfg = dataclasses.replace(LORA, base_dtype="int8", experts=True)
    params, logical, _ = _setup(MOE, lcfg)
    # jitted: eagerly, each quantising op compiles once per leaf shape
    store_base = jax.jit(lambda p: lora.store_base(p, logical, lcfg))
    base = store_base(params)
    q8 = base["blocks"]["moe"]["attn"]["q"]
    assert isinstance(q8, lora.Int8Weight) and q8.values.dtype == jnp.int8
    assert q8.scale.shape == (1, 1, 2, 8)  # reduced over d_model only: one scale per layer and output column
    assert base["blocks"]["moe"]["moe"]["gate"].scale.shape == (1, 3, 1, 24)  # per layer, expert and column
    assert base["blocks"]["moe"]["moe"]["router"].dtype == jnp.float32  # routers are never quantised
    assert base["final_norm"]["scale"].dtype == jnp.float32
    dense_base = jax.jit(lora.dense_base)
    dense = dense_base(base)
    for w, d, b in [(params["blocks"]["moe"]["attn"]["q"], dense["blocks"]["moe"]["attn"]["q"], q8)]:
        assert float(np.max(np.abs(np.asarray(w) - np.asarray(d)) - np.asarray(b.scale) / 2)) <= 1e-7
    # The per-layer scale is the point: one layer with 100x larger weights must not flatten the other.
    # (A 2-layer stack: the MoE model's dense_0 has one layer, where an index 1 is out of bounds.)
    logical_o = {"o": param_logical_axes(DENSE)["blocks"]["attn"]["o"]}
    w = np.array(init_params(DENSE, jax.random.key(0))["blocks"]["attn"]["o"])
    assert w.shape[0] == 2
    w[0] *= 100.0
    big = jax.jit(lambda t: lora.store_base(t, logical_o, lcfg))({"o": w})
    assert isinstance(big["o"], lora.Int8Weight)
    np.testing.assert_allclose(dense_base(big)["o"][1], w[1], atol=float(np.abs(w[1]).max()) / 127)
    bf = jax.jit(lambda p: lora.store_base(p, logical, dataclasses.replace(LORA, base_dtype="bfloat16")))(params)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf))


@pytest.mark.parametrize(
    "setting,field",
    [
        ("model.lora.rank=-1", "model.lora.rank"),
        ("model.lora.alpha=0", "model.lora.alpha"),
        ("model.lora.dropout=0.1", "model.lora.dropout"),
        ("model.lora.targets=q,qq", "model.lora.targets"),
        ("model.lora.base_dtype=fp8", "model.lora.base_dtype"),
    ],
)
def test_bad_lora_settings_name_the_field(setting, field):
    cfg = apply_overrides(Config(), [setting])
    with pytest.raises(ConfigError, match=field):
        cfg.model.validate()


def test_targets_parse_from_the_command_line():
    cfg = apply_overrides(Config(), ["model.lora.rank=8", "model.lora.targets=q, v"])
    assert cfg.model.lora.targets == ("q", "v") and cfg.model.lora.enabled and cfg.model.lora.scale == 2.0
    hash(cfg.model)  # the model config stays a valid static jit argument


def test_fingerprint_tells_bases_apart():
    params, logical, _ = _setup(DENSE, LORA)
    fp = lora.fingerprint(params)
    assert lora.same_fingerprint(fp, lora.fingerprint(jax.tree.map(jnp.copy, params)))
    other = jax.tree.map(lambda x: x, params)
    other["blocks"]["attn"]["q"] = other["blocks"]["attn"]["q"].at[0, 0, 0, 0].add(0.05)
    assert not lora.same_fingerprint(fp, lora.fingerprint(other))
    assert not lora.same_fingerprint(fp, fp[:-2])


def test_model_config_round_trips_its_json_form_with_the_lora_section():
    cfg = dataclasses.replace(DENSE, lora=LoraConfig(rank=4, targets=("q", "v"), base_dtype="int8"))
    saved = json.loads(json.dumps(dataclasses.asdict(cfg)))  # as config.json / model_config.json hold it
    assert ModelConfig.from_dict(saved) == cfg
    assert ModelConfig.from_dict({**saved, "a_field_from_the_future": 1}) == cfg
    no_lora = {k: v for k, v in saved.items() if k != "lora"}  # written before LoRA existed
    assert ModelConfig.from_dict(no_lora).lora == LoraConfig()
