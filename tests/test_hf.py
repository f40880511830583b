"""Hugging Face interop: tiny random transformers models (built offline, saved with save_pretrained)
load into jaxrl with the same logits (max abs diff <= 1e-4, float32) and the same 20-token greedy
generation; export -> transformers reload gives identical logits; bad checkpoints are one-line errors
naming the tensor / architecture / config key.

Each architecture covers some of: GQA with one kv head, head_dim != hidden/heads, tied and untied
embeddings, non-default rope theta, Llama 3 rope scaling, bfloat16 safetensors, a sharded index,
MoE every 2nd layer, un-normalised top-k gates, a gated shared expert, dense layers after the last MoE
layer (decoder_sparse_step not dividing the layer count; mlp_only_layers). Weights are redrawn at O(1)
scale (norm scales and biases too), so a wrong layout or a missing term shows in the logits.
"""

import dataclasses
import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrl.models import hf, safetensors_io  # noqa: E402
from jaxrl.models.transformer import forward  # noqa: E402
from jaxrl.rollout.sampler import SamplingParams, sample  # noqa: E402

V = 96
COMMON = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# name -> (model_type, config kwargs, save_pretrained kwargs / how the checkpoint is stored)
CASES = {
    "llama": (
        "llama",
        dict(num_key_value_heads=1, head_dim=24, tie_word_embeddings=False, rope_theta=500000.0, rope_scaling=LLAMA3),
        {},
    ),
    "qwen2": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6), {"bf16": True}),
    "qwen3": ("qwen3", dict(num_key_value_heads=1, head_dim=32, tie_word_embeddings=False), {"max_shard_size": "40KB"}),
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            tie_word_embeddings=True,
        ),
        {},
    ),
    "qwen2_moe": (
        "qwen2_moe",
        dict(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
        {},
    ),
    # transformers: layer i is MoE iff (i+1) % decoder_sparse_step == 0 and i not in mlp_only_layers.
    # 3 layers, step 2: only layer 1 is MoE, layer 2 is a trailing dense layer.
    "qwen3_moe_tail": (
        "qwen3_moe",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            tie_word_embeddings=True,
        ),
        {},
    ),
    # 5 layers, step 2, mlp_only_layers=[3]: only layer 1 is MoE; layers 2, 3, 4 are dense.
    "qwen2_moe_mlp_only": (
        "qwen2_moe",
        dict(
            num_hidden_layers=5,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
            shared_expert_intermediate_size=32,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
        {},
    ),
}


def _randomize(model, seed):
    """O(1)-scale weights: normal/sqrt(fan_in) matrices, 1 +- 0.3 norm scales, 0.3-std biases."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def build(root, name):
    model_type, kw, store = CASES[name]
    cfg = transformers.AutoConfig.for_model(model_type, **{**COMMON, **kw})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    _randomize(model, seed=len(name))
    if model.config.tie_word_embeddings:
        model.tie_weights()
    d = root / name
    if store.get("bf16"):
        model = model.to(torch.bfloat16)
    model.save_pretrained(d, **{k: v for k, v in store.items() if k != "bf16"})
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return d, ref


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: build(root, name) for name in CASES}


def _tokens(seed, shape):
    return np.random.default_rng(seed).integers(3, V, shape)


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


@pytest.mark.slow
def test_checkpoints_cover_the_cases(models):
    assert (models["qwen3"][0] / safetensors_io.INDEX).is_file()
    header = safetensors_io.read_file(models["qwen2"][0] / safetensors_io.SINGLE)
    assert {str(a.dtype) for a in header.values()} == {"bfloat16"}
    cfgs = {name: hf.model_config(hf.read_config(d)) for name, (d, _) in models.items()}
    assert cfgs["llama"].n_kv_heads == 1 and cfgs["llama"].head_dim == 24 and cfgs["llama"].rope_scaling == "llama3"
    assert cfgs["qwen2"].tie_embeddings and cfgs["qwen2"].qkv_bias and cfgs["qwen2"].rope_theta == 1e6
    assert cfgs["qwen3"].qk_norm and cfgs["qwen3"].head_dim == 32
    assert cfgs["qwen3_moe"].moe_every == 2 and cfgs["qwen3_moe"].router_norm_topk
    assert cfgs["qwen2_moe"].n_shared_experts == 2 and not cfgs["qwen2_moe"].router_norm_topk
    tail, only = cfgs["qwen3_moe_tail"], cfgs["qwen2_moe_mlp_only"]
    assert (tail.moe_every, tail.n_moe_layers, tail.dense_tail_layers) == (2, 1, 1)
    assert (only.moe_every, only.n_moe_layers, only.dense_tail_layers) == (2, 1, 3)
    # The transformers models agree: which layers hold experts.
    assert [type(layer.mlp).__name__ for layer in models["qwen2_moe_mlp_only"][1].model.layers] == [
        "Qwen2MoeMLP",
        "Qwen2MoeSparseMoeBlock",
        "Qwen2MoeMLP",
        "Qwen2MoeMLP",
        "Qwen2MoeMLP",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_generation_match_transformers(models, name):
    d, ref = models[name]
    cfg, params = hf.load(d)
    tokens = _tokens(1, (2, 16))
    ours = np.asarray(forward(params, cfg, jnp.asarray(tokens), jnp.ones(tokens.shape, bool)))
    np.testing.assert_allclose(ours, _hf_logits(ref, tokens), atol=1e-4, rtol=0)

    prompt = _tokens(2, (2, 6))
    with torch.no_grad():
        want = ref.generate(
            torch.tensor(prompt),
            attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            do_sample=False,
            max_new_tokens=20,
            min_new_tokens=20,
            eos_token_id=None,
            pad_token_id=0,
        )[:, prompt.shape[1] :].numpy()
    if cfg.n_experts:  # the naive (every-expert) dispatch compiles twice as fast on CPU; logits above used dropless
        cfg = dataclasses.replace(cfg, moe_dispatch="naive")
    out = sample(
        params,
        cfg,
        jnp.asarray(prompt, jnp.int32),
        jnp.ones(prompt.shape, bool),
        jax.random.key(0),
        group_size=1,
        sampling=SamplingParams(max_new_tokens=20, temperature=1.0, eos_id=V + 1, pad_id=0, greedy=True),
    )
    np.testing.assert_array_equal(np.asarray(out.tokens_BxT), want)


@pytest.mark.slow
def test_left_padded_row_matches_unpadded_transformers_logits(models):
    d, ref = models["qwen2"]  # q/k/v biases: padding must stay invisible with them too
    cfg, params = hf.load(d)
    tokens = _tokens(3, (2, 16))  # the shape of the parity test above: its compiled forward is reused
    mask = np.ones(tokens.shape, bool)
    mask[0, :3] = False
    ours = np.asarray(forward(params, cfg, jnp.asarray(tokens), jnp.asarray(mask)))
    np.testing.assert_allclose(ours[:1, 3:], _hf_logits(ref, tokens[:1, 3:]), atol=1e-4, rtol=0)
    np.testing.assert_allclose(ours[1:], _hf_logits(ref, tokens[1:]), atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,dtype,shard",
    [
        ("llama", "float32", 0),
        ("qwen3", "float32", 30_000),
        ("qwen3_moe", "float32", 0),
        ("qwen2_moe", "bfloat16", 0),
        ("qwen3_moe_tail", "float32", 0),
        ("qwen2_moe_mlp_only", "float32", 0),
    ],
)
def test_export_reloads_in_transformers_with_identical_logits(models, tmp_path, name, dtype, shard):
    d, ref = models[name]
    cfg, params = hf.load(d)
    files = hf.save(tmp_path, params, cfg, dtype=dtype, max_shard_bytes=shard, bos_token_id=1, eos_token_id=2)
    assert (safetensors_io.INDEX in files) == bool(shard)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(back).__name__ == type(ref).__name__
    tokens = _tokens(4, (2, 12))
    if dtype == "float32":
        np.testing.assert_array_equal(_hf_logits(back, tokens), _hf_logits(ref, tokens))
    else:  # bf16 rounding of the weights: the reload equals the reference up to that rounding
        np.testing.assert_allclose(_hf_logits(back, tokens), _hf_logits(ref, tokens), atol=0.2)
    cfg2, params2 = hf.load(tmp_path)
    assert dataclasses.replace(cfg2, hf_path="") == dataclasses.replace(cfg, hf_path="")
    if dtype == "float32":
        jax.tree.map(np.testing.assert_array_equal, params2, params)


def _copy_with(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = {k: np.array(v) for k, v in safetensors_io.read_dir(dst).items()}
    for f in dst.glob("*.safetensors*"):
        f.unlink()
    edit(tensors)
    safetensors_io.write_dir(dst, tensors)
    return dst


@pytest.mark.slow
def test_missing_tensor_is_named(models, tmp_path):
    d = _copy_with(models["qwen2"][0], tmp_path / "c", lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(
        hf.CheckpointError,
        match=r"'model\.layers\.1\.self_attn\.k_proj\.bias' is missing "
        r"\(expected shape \(32,\)",
    ):
        hf.load(d)


@pytest.mark.slow
def test_wrong_shape_is_named(models, tmp_path):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    d = _copy_with(models["qwen3_moe"][0], tmp_path / "c", lambda t: t.update({name: np.zeros((31, 64), np.float32)}))
    with pytest.raises(hf.CheckpointError, match=rf"'{name}' has shape \(31, 64\), expected \(32, 64\)"):
        hf.load(d)


@pytest.mark.slow
def test_unused_tensor_is_named(models, tmp_path):
    # Layer 0 is dense (decoder_sparse_step=2): an expert tensor there means the config does not fit.
    name = "model.layers.0.mlp.experts.0.up_proj.weight"
    d = _copy_with(models["qwen3_moe"][0], tmp_path / "c", lambda t: t.update({name: np.zeros((32, 64), np.float32)}))
    with pytest.raises(hf.CheckpointError, match=rf"'{name}' is not used by the model"):
        hf.load(d)


def _config_error(models, tmp_path, edit):
    d = tmp_path / "c"
    shutil.copytree(models["llama"][0], d)
    config = json.loads((d / "config.json").read_text())
    edit(config)
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(hf.CheckpointError) as e:
        hf.load(d)
    return str(e.value)


@pytest.mark.slow
def test_unsupported_architecture_and_config_keys_are_named(models, tmp_path):
    msg = _config_error(models, tmp_path, lambda c: c.update(architectures=["MistralForCausalLM"]))
    assert "architecture 'MistralForCausalLM' is not supported" in msg and "LlamaForCausalLM" in msg
    shutil.rmtree(tmp_path / "c")
    msg = _config_error(
        models, tmp_path, lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    )
    assert "rope scaling type 'yarn' is not supported" in msg
    shutil.rmtree(tmp_path / "c")
    msg = _config_error(models, tmp_path, lambda c: c.update(attention_bias=True))
    assert "attention_bias=True is not supported" in msg
    moe = hf.read_config(models["qwen3_moe"][0])
    # A dense layer between MoE layers has no place in the scanned stack: refused, naming the layers.
    with pytest.raises(
        hf.CheckpointError,
        match=r"mlp_only_layers=\[0\] makes layers \[1, 2, 3\] MoE, which is "
        r"not supported",
    ):
        hf.model_config({**moe, "num_hidden_layers": 4, "decoder_sparse_step": 1, "mlp_only_layers": [0]})
    with pytest.raises(hf.CheckpointError, match="decoder_sparse_step=0 is not supported"):
        hf.model_config({**moe, "decoder_sparse_step": 0})
    # Step 3 over 2 layers, or every MoE layer listed in mlp_only_layers: transformers builds no MoE layer.
    assert hf.model_config({**moe, "decoder_sparse_step": 3}).n_experts == 0
    assert hf.model_config({**moe, "mlp_only_layers": [1]}).n_experts == 0


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("rope_scaling", "yarn", "model.rope_scaling: got 'yarn', expected 'none' or 'llama3'"),
        (
            "rope_high_freq_factor",
            0.5,
            "model.rope_high_freq_factor: got 0.5, expected a number > rope_low_freq_factor",
        ),
        ("rope_original_max_len", 0, "model.rope_original_max_len: got 0"),
        ("shared_expert_gate", True, "model.shared_expert_gate: got True, expected False unless n_shared_experts > 0"),
    ],
)
def test_new_model_fields_are_validated(field, value, match):
    from jaxrl.config import ConfigError, ModelConfig

    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(ModelConfig(), **{field: value}).validate()


@pytest.mark.slow
def test_trailing_dense_layers_sample_replay_and_train(models):
    """The MoE model with dense layers after its MoE layer: the sampler's routing replayed by the trainer
    gives the sampler's log-probs, and one SGD step on them lowers the loss, with gradient reaching the
    tail's dense layers and the experts."""
    from jaxrl.train.steps import make_logp_fn

    cfg, params = hf.load(models["qwen2_moe_mlp_only"][0])
    cfg = dataclasses.replace(cfg, moe_dispatch="naive")
    prompt, G = jnp.asarray(_tokens(5, (2, 6)), jnp.int32), 2
    out = sample(
        params,
        cfg,
        prompt,
        jnp.ones(prompt.shape, bool),
        jax.random.key(1),
        group_size=G,
        sampling=SamplingParams(max_new_tokens=5, temperature=1.0, eos_id=V + 1, pad_id=0),
    )
    assert out.routing_BxSxLxK.shape == (2 * G, 6 + 5, 1, 2)  # one MoE layer of five
    batch = {
        "prompt_tokens_BxP": jnp.repeat(prompt, G, 0),
        "prompt_mask_BxP": jnp.ones((2 * G, 6), jnp.int32),
        "tokens_BxT": out.tokens_BxT,
        "completion_mask_BxT": out.completion_mask_BxT,
        "routing_BxSxLxK": out.routing_BxSxLxK,
    }
    logp_fn = make_logp_fn(cfg, 1.0, routing_replay=True)

    def nll(p):
        logp, _, extra = logp_fn(p, batch)
        return -jnp.mean(logp), (logp, extra)

    # One compiled program gives the log-probs, the loss and its gradient (and, reused, the stepped loss).
    nll_and_grad = jax.jit(jax.value_and_grad(nll, has_aux=True))
    (loss, (logp, extra)), grads = nll_and_grad(params)
    np.testing.assert_allclose(logp, out.logp_BxT, atol=1e-5)
    assert float(jnp.sum(extra["moe/routing_mismatch_BxT"])) == 0.0
    assert set(params) == {"embedding", "blocks", "tail", "final_norm", "lm_head"}
    assert jax.tree.leaves(params["tail"])[0].shape[0] == 3  # layers 2, 3, 4
    for part in (grads["tail"]["mlp"]["down"], grads["blocks"]["moe"]["moe"]["down"], grads["blocks"]["dense_0"]):
        assert all(np.max(np.abs(g)) > 0 and np.all(np.isfinite(g)) for g in map(np.asarray, jax.tree.leaves(part)))
    stepped = jax.tree.map(lambda p, g: np.asarray(p) - 1e-2 * np.asarray(g), params, grads)  # numpy: no compiles
    assert float(nll_and_grad(stepped)[0][0]) < float(loss)


@pytest.mark.slow
def test_export_keeps_the_checkpoint_context_length_and_rope_scaling(models, tmp_path):
    """A Llama 3 checkpoint made for 4096 positions, run at max_seq_len 32: export (directly, and through
    `convert --from-hf` then `--to-hf`) writes 4096 and the same llama3 rope fields back."""
    from jaxrl.config import ModelConfig
    from jaxrl.policy.convert import convert_from_hf, convert_to_hf

    d = tmp_path / "llama4k"
    shutil.copytree(models["llama"][0], d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    cfg, params = hf.load(d, ModelConfig(max_seq_len=32))
    hf.save(tmp_path / "direct", params, cfg)
    convert_from_hf(d, tmp_path / "conv")
    convert_to_hf(tmp_path / "conv", tmp_path / "via_convert")
    tokens = _tokens(6, (1, 10))
    for out in ("direct", "via_convert"):
        written = json.loads((tmp_path / out / "config.json").read_text())
        assert written["max_position_embeddings"] == 4096, out  # was 512: max(32, 64 * 8) from the rope fields
        assert written["rope_scaling"] == {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }, out
        assert written["rope_theta"] == 500000.0, out
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / out, dtype=torch.float32).eval()
        assert back.config.max_position_embeddings == 4096
        np.testing.assert_array_equal(_hf_logits(back, tokens), _hf_logits(ref, tokens))
    assert (cfg.max_seq_len, cfg.hf_max_position_embeddings) == (32, 4096)


@pytest.mark.slow
def test_load_without_base_runs_at_the_checkpoint_context(models):
    """hf.load(d) runs at the checkpoint's max_position_embeddings (256 here), not a silent 64; a config.json
    without one needs the run's length stated."""
    from jaxrl.config import ModelConfig

    cfg, _ = hf.load(models["qwen3"][0])
    assert cfg.max_seq_len == 256
    assert hf.load(models["qwen3"][0], ModelConfig(max_seq_len=48))[0].max_seq_len == 48
    no_context = {k: v for k, v in hf.read_config(models["qwen3"][0]).items() if k != "max_position_embeddings"}
    with pytest.raises(hf.CheckpointError, match="'max_position_embeddings' is missing; give the run's length"):
        hf.model_config(no_context)
    assert hf.model_config(no_context, ModelConfig(max_seq_len=16)).max_seq_len == 16


@pytest.mark.slow
def test_two_checkpoints_of_one_architecture_compile_once(models, tmp_path):
    """The model config holds no path, so a second checkpoint of the same architecture gives an equal
    static config and reuses the compiled forward."""
    cfg, params = hf.load(models["qwen3"][0])
    other = tmp_path / "qwen3_copy"
    shutil.copytree(models["qwen3"][0], other)
    cfg2, params2 = hf.load(other)
    assert cfg2 == cfg and hash(cfg2) == hash(cfg) and cfg.hf_path == ""
    tokens = jnp.asarray(_tokens(7, (1, 5)))
    forward(params, cfg, tokens, jnp.ones(tokens.shape, bool))
    compiled = forward._cache_size()
    forward(params2, cfg2, tokens, jnp.ones(tokens.shape, bool))
    assert forward._cache_size() == compiled
