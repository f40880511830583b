"""Exporting and evaluating a LoRA run (jaxrl.policy.lora_run, jaxrl.models.peft_export).

The runs are written as the trainer writes them (checkpoint.save of a TrainState whose params are the
adapters, the base left out, the JSON item's "lora" pointer; RunRecord's config.json), with random
nonzero B so the adapters change the logits. The merged export reloads in transformers with our merged
policy's logits; the PEFT directory, loaded by peft onto the exported base, gives the merged export's
logits; eval's policy is the same merge; a wrong base, a missing warm start and --peft-adapter on a
full fine-tuning run are one-line errors.
"""

import dataclasses
import functools
import json
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import test_hf as th  # noqa: E402
from conftest import DEFAULT_CONFIG, TINY  # noqa: E402

from jaxrl import cli  # noqa: E402
from jaxrl.config import CheckpointConfig, Config, ConfigError, ModelConfig, OptimConfig, load_config  # noqa: E402
from jaxrl.config.lora import LoraConfig  # noqa: E402
from jaxrl.models import lora, peft_export, safetensors_io  # noqa: E402
from jaxrl.models.transformer import forward, param_logical_axes  # noqa: E402
from jaxrl.policy import lora_run  # noqa: E402
from jaxrl.policy.convert import convert_to_hf  # noqa: E402
from jaxrl.policy.pretrained import load_model  # noqa: E402
from jaxrl.train import checkpoint  # noqa: E402
from jaxrl.train.state import init_state, make_optimizer  # noqa: E402
from jaxrl.train.workdir import RunRecord  # noqa: E402


def _random_adapters(params, model_cfg, lcfg, seed):
    """init_adapters' tree with every A and B redrawn (B = 0 would hide any layout mistake). In numpy:
    eager jax.random would compile a sampler for every leaf shape."""
    shapes = jax.eval_shape(
        lambda p: lora.init_adapters(p, param_logical_axes(model_cfg), lcfg, jax.random.key(0)), params
    )
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(0.3 * rng.normal(size=x.shape), jnp.float32), shapes)


@functools.cache
def _jitted_store_base(model_cfg: ModelConfig, lcfg: LoraConfig):
    """lora.store_base as one jitted program per model (eagerly, every op compiles per leaf shape)."""
    logical = param_logical_axes(model_cfg)
    return jax.jit(lambda params: lora.store_base(params, logical, lcfg))


@functools.cache
def _jitted_merge(model_cfg: ModelConfig, lcfg: LoraConfig):
    """lora.merge as one jitted program per model."""
    logical = param_logical_axes(model_cfg)
    return jax.jit(lambda base, adapters: lora.merge(base, adapters, lcfg, logical))


def _store_base(params, model_cfg, lcfg):
    return _jitted_store_base(model_cfg, lcfg)(params)


def _merge(base, adapters, model_cfg, lcfg):
    return _jitted_merge(model_cfg, lcfg)(base, adapters)


def write_lora_run(run: pathlib.Path, cfg: Config, base_params, model_cfg, base_path, step=3, fingerprint=None):
    """A LoRA run directory as the trainer leaves it; returns (adapters, the stored base)."""
    lcfg = cfg.model.lora
    run.mkdir(parents=True)
    RunRecord(run, cfg, None, {}, True).write_config()
    if not lcfg.enabled:  # full fine-tuning: the params themselves
        adapters, base = base_params, None
    else:
        adapters = _random_adapters(base_params, model_cfg, lcfg, seed=step)
        base = _store_base(base_params, model_cfg, lcfg)
    state = init_state(adapters, make_optimizer(OptimConfig(), 10), jax.random.key(0))._replace(
        step=jnp.asarray(step, jnp.int32)
    )
    host = {"stream": {"epoch": 0, "position": 0}}
    if lcfg.enabled:
        host["lora"] = {"base_path": str(base_path), "fingerprint": fingerprint or lora.fingerprint(base)}
    manager = checkpoint.make_manager(run, CheckpointConfig())
    checkpoint.save(manager, step, state, host, force=True)
    manager.wait_until_finished()
    manager.close()
    return adapters, base


def _hf_run(tmp_path, models, name, base_dtype):
    d, _ = models[name]
    lcfg = LoraConfig(rank=4, alpha=8.0, base_dtype=base_dtype)
    cfg = Config(model=ModelConfig(hf_path=str(d), max_seq_len=64, lora=lcfg)).validate()
    model_cfg, params = load_model(cfg.model)
    adapters, base = write_lora_run(tmp_path / "run", cfg, params, model_cfg, d)
    return cfg, model_cfg, params, _merge(base, adapters, model_cfg, lcfg)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: th.build(root, name) for name in ("qwen2", "llama")}


def _ours(params, model_cfg, tokens):
    return np.asarray(forward(params, model_cfg, jnp.asarray(tokens), jnp.ones(tokens.shape, bool)))


@pytest.mark.slow
@pytest.mark.parametrize("name,base_dtype", [("qwen2", "bfloat16"), ("llama", "int8")])
def test_merged_and_peft_exports_reload_with_our_merged_logits(models, tmp_path, name, base_dtype):
    cfg, model_cfg, params, merged = _hf_run(tmp_path, models, name, base_dtype)
    tokens = th._tokens(5, (2, 12))
    want = _ours(merged, model_cfg, tokens)
    assert np.abs(want - _ours(params, model_cfg, tokens)).max() > 0.05  # the adapters matter

    convert_to_hf(tmp_path / "run", tmp_path / "merged")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    merged_logits = th._hf_logits(back, tokens)
    np.testing.assert_allclose(merged_logits, want, atol=1e-4, rtol=0)

    convert_to_hf(tmp_path / "run", tmp_path / "base", peft_dir=tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / peft_export.CONFIG).read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "base").absolute())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert sorted(config["target_modules"]) == sorted(f"{t}_proj" for t in ("q", "k", "v", "o", "gate", "up", "down"))
    tensors = safetensors_io.read_file(tmp_path / "adapter" / peft_export.WEIGHTS)
    prefix = "base_model.model.model.layers.1."
    q_out = model_cfg.n_heads * model_cfg.head_dim
    assert tensors[prefix + "self_attn.q_proj.lora_A.weight"].shape == (4, model_cfg.d_model)
    assert tensors[prefix + "self_attn.q_proj.lora_B.weight"].shape == (q_out, 4)
    assert tensors[prefix + "self_attn.o_proj.lora_A.weight"].shape == (4, q_out)
    assert tensors[prefix + "mlp.down_proj.lora_B.weight"].shape == (model_cfg.d_model, 4)

    base = transformers.AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    base_logits = th._hf_logits(base.eval(), tokens)
    np.testing.assert_allclose(
        base_logits, _ours(jax.jit(lora.dense_base)(_store_base(params, model_cfg, cfg.model.lora)),
                           model_cfg, tokens), atol=1e-4, rtol=0,
    )  # fmt: skip
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert len([m for m in with_adapter.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]) == 7 * 2
    np.testing.assert_allclose(th._hf_logits(with_adapter, tokens), merged_logits, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_a_different_base_and_peft_on_full_fine_tuning_are_one_line_errors(models, tmp_path, capsys):
    d, _ = models["qwen2"]
    lcfg = LoraConfig(rank=4, alpha=8.0)
    cfg = Config(model=ModelConfig(hf_path=str(d), max_seq_len=64, lora=lcfg)).validate()
    model_cfg, params = load_model(cfg.model)
    other = lora.fingerprint(jax.tree.map(lambda w: w * 1.01, params))  # trained on another base
    write_lora_run(tmp_path / "run", cfg, params, model_cfg, d, fingerprint=other)
    with pytest.raises(ConfigError, match=f"another base than {d}") as e:
        convert_to_hf(tmp_path / "run", tmp_path / "out")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()

    full = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=LoraConfig()))
    write_lora_run(tmp_path / "full", full, params, model_cfg, d)
    code = cli.main(["convert", "--from", str(tmp_path / "full"), "--to-hf", str(tmp_path / "b"),
                     "--peft-adapter", str(tmp_path / "a")])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and err.startswith("jaxrl: error: --peft-adapter:")
    assert "is not a LoRA run" in err and not (tmp_path / "b").exists()


@pytest.fixture(scope="module")
def warmstart_run(cache_env, tmp_path_factory):
    """A LoRA run on the cached warm start of a tiny character model (the base trained for 2 steps)."""
    from jaxrl.data.tasks import load_task
    from jaxrl.data.tokenizer import CharTokenizer
    from jaxrl.policy.warmstart import load_or_train_base

    tmp = tmp_path_factory.mktemp("lora_warmstart")
    cfg = load_config(DEFAULT_CONFIG, [*TINY, "warmstart.steps=2", "model.lora.rank=2", "model.lora.alpha=4",
                                       f"warmstart.cache_dir={tmp / 'ws'}"])  # fmt: skip
    tokenizer = CharTokenizer()
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXRL_DATA_DIR", cache_env["JAXRL_DATA_DIR"])
        train = load_task(cfg.data).train
    params, path = load_or_train_base(cfg, model_cfg, tokenizer, train, tokenizer.alphabet, False)
    adapters, base = write_lora_run(tmp / "run", cfg, params, model_cfg, path)
    merged = _merge(base, adapters, model_cfg, cfg.model.lora)
    return tmp / "run", cfg, model_cfg, params, merged


@pytest.mark.slow
def test_eval_and_convert_of_a_warm_start_lora_run(warmstart_run, tmp_path):
    from jaxrl.eval.sources import load_policy, locate, run_model
    from jaxrl.sharding import make_mesh

    run, cfg, model_cfg, params, merged = warmstart_run
    # `jaxrl eval CONFIG --workdir RUN` with a config that has no adapters: the run's model.lora wins.
    user_cfg = load_config(DEFAULT_CONFIG, [*TINY, f"warmstart.cache_dir={cfg.warmstart.cache_dir}"])
    located = locate(str(run), None, None, None)
    eval_cfg = run_model(user_cfg, located)
    assert eval_cfg.model.lora == cfg.model.lora
    mesh, preset = make_mesh(eval_cfg.mesh)
    policy = load_policy(eval_cfg, located, mesh, preset, None, False)
    assert policy.origin == str(run / "checkpoints" / "3")
    for got, want in zip(jax.tree.leaves(policy.params), jax.tree.leaves(merged)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert any(not np.array_equal(w, b) for w, b in zip(jax.tree.leaves(merged), jax.tree.leaves(params)))

    convert_to_hf(run, tmp_path / "merged")
    _, exported = load_model(ModelConfig(hf_path=str(tmp_path / "merged"), max_seq_len=model_cfg.max_seq_len))
    for got, want in zip(jax.tree.leaves(exported), jax.tree.leaves(merged)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)


@pytest.mark.slow
def test_a_missing_warm_start_base_is_a_one_line_error(warmstart_run, tmp_path, capsys):
    _, cfg, model_cfg, params, _ = warmstart_run
    moved = dataclasses.replace(cfg, warmstart=dataclasses.replace(cfg.warmstart, cache_dir=str(tmp_path / "empty")))
    write_lora_run(tmp_path / "run", moved, params, model_cfg, cfg.warmstart.cache_dir)
    code = cli.main(["convert", "--from", str(tmp_path / "run"), "--to-hf", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert f"the run's warm-start base {tmp_path / 'empty'}/" in err
    assert "is missing: recreate it with `jaxrl eval`" in err and not (tmp_path / "out").exists()


def test_run_config_round_trips_config_json(tmp_path):
    cfg = load_config(DEFAULT_CONFIG, [*TINY, "model.lora.rank=3", "model.lora.targets=q,v", "loss.kl_beta=0.01"])
    RunRecord(tmp_path, cfg, None, {}, True).write_config()
    assert lora_run.run_config(tmp_path) == cfg
