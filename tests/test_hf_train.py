"""`jaxrl train` from a Hugging Face checkpoint: the GSM8K recipe on a tiny stand-in (a tiny random
Qwen2 with its own tiny tokenizer, a 5-line JSONL) runs 2 GRPO steps on CPU; `jaxrl convert` both ways;
the math-answer verifier. The loading of a checkpoint onto an 8-device mesh runs in one subprocess."""

import json
import subprocess
import sys
import warnings

import numpy as np
import pytest
from harness import child_env

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from conftest import REPO  # noqa: E402
from hf_stand_in import CHATML_SPECIALS, save_bpe_tokenizer, save_tiny_qwen2  # noqa: E402

from jaxrl.cli import main  # noqa: E402
from jaxrl.config import load_config  # noqa: E402
from jaxrl.data.math_jsonl import extract_answer, verify_math_answer  # noqa: E402

RECIPE = REPO / "configs" / "qwen2.5_0.5b_gsm8k_grpo.py"
PROBLEMS = [
    ("Natalia sold 48 clips in April and half as many in May. How many in total?", "48 + 24 = 72\n#### 72"),
    ("Weng earns $12 an hour. How much for 50 minutes?", "12/60*50 = 10\n#### 10"),
    ("Betty needs $100 and has half. Parents give $15, grandparents twice that. How much more?", "#### 5"),
    ("James writes 3 pages to 2 friends twice a week. Pages a year?", "3*2*2*52 = 624\n#### 624"),
    ("Mark has 10 yellow flowers and 80% more purple ones. How many purple?", "#### 1,800"),
]


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """A tiny Qwen2 checkpoint with a ChatML-capable BPE tokenizer, and a 5-line GSM8K-style JSONL."""
    root = tmp_path_factory.mktemp("stand_in")
    d = root / "qwen_tiny"
    d.mkdir()
    save_bpe_tokenizer(
        d,
        [q + " " + a for q, a in PROBLEMS] * 10,
        300,
        CHATML_SPECIALS,
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    )
    save_tiny_qwen2(d, 320, eos_token_id=2, pad_token_id=0)
    jsonl = root / "gsm8k.jsonl"
    jsonl.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in PROBLEMS))
    return d, jsonl


def test_math_answer_verifier():
    record = {"answer": "1800"}
    assert verify_math_answer("so 10*1.8 = 18, times 100 ... #### 1,800", True, record) == (1.0, 1.0)
    assert verify_math_answer("The answer is \\boxed{1800.0}", False, record) == (1.0, 0.0)
    assert verify_math_answer("I think the answer is 1800 apples", True, record) == (1.0, 0.0)
    assert verify_math_answer("first 18, then 1800, finally 17", True, record) == (0.0, 0.0)
    assert verify_math_answer("no number here", True, record) == (0.0, 0.0)
    assert extract_answer("#### $-3.50")[0] == -3.5


def stand_in_overrides(d, jsonl) -> list[str]:
    """The recipe shrunk to two 2x2-row GRPO steps on the stand-in checkpoint `d` and its data `jsonl`."""
    return [
        f"model.hf_path={d}",
        f"data.train_file={jsonl}",
        "data.test_file=",
        "data.num_test=1",
        "model.dtype=float32",
        "data.prompt_template=Q: {question} A:",
        "data.max_prompt_len=64",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=6",
        "train.steps=2",
        "train.eval_prompts=1",
        "train.eval_every=0",
        "train.microbatches=1",
        "train.progress=false",
        "mesh.preset=single",
    ]


@pytest.mark.slow
def test_recipe_runs_two_grpo_steps_on_the_stand_in(stand_in, tmp_path, in_process_cache, capsys):
    from jaxrl.train.loop import train

    d, jsonl = stand_in
    cfg = load_config(
        RECIPE,
        [
            *stand_in_overrides(d, jsonl),
            "checkpoint.every=0",
            "optim.learning_rate=1e-3",
            "optim.warmup_steps=0",
        ],
    )
    rows = train(cfg, tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(np.isfinite(r["loss"]) for r in rows[1:])

    # The trained policy goes back to transformers (bfloat16, sharded), with the checkpoint's tokenizer.
    out = tmp_path / "hf_out"
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(
            [
                "convert",
                "--from",
                str(tmp_path / "run"),
                "--to-hf",
                str(out),
                "--dtype",
                "bfloat16",
                "--max-shard-mb",
                "0",
            ]
        )
    assert code == 0
    err = capsys.readouterr().err  # one line saying what was written where; no orbax topology warning
    assert f"jaxrl: wrote {tmp_path / 'run'} (" in err and f"to {out} as a Hugging Face checkpoint (bfloat16)" in err
    assert not [w for w in caught if "Sharding info" in str(w.message)], [str(w.message) for w in caught]
    assert (out / "tokenizer.json").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert back.config.eos_token_id == 2 and back.dtype == torch.bfloat16
    # The checkpoint's context length survives the run (max_seq_len=1024 in the recipe), as does the arch.
    assert json.loads((d / "config.json").read_text())["max_position_embeddings"] == 32768
    assert back.config.max_position_embeddings == 32768 and cfg.model.max_seq_len == 1024


@pytest.mark.slow
def test_lora_on_the_hf_stand_in_trains_adapters_over_its_weights(stand_in, tmp_path, in_process_cache):
    """model.lora on a checkpoint loaded from model.hf_path: the KL against the base starts at exactly
    0, and the checkpoint points at the HF directory as its base (adapters only)."""
    from jaxrl.train.loop import train

    d, jsonl = stand_in
    overrides = [
        *stand_in_overrides(d, jsonl),
        "checkpoint.every=2",
        "loss.kl_beta=0.1",
        "model.lora.rank=2",
        "model.lora.base_dtype=bfloat16",
    ]
    rows = train(load_config(RECIPE, overrides), tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[1]["kl"] == 0.0
    assert all(np.isfinite(r["loss"]) for r in rows[1:])
    host = json.loads((tmp_path / "run" / "checkpoints" / "2" / "host" / "metadata").read_text())
    assert host["lora"]["base_path"] == str(d)


def test_convert_from_hf_then_train_start_loads_the_same_model(stand_in, tmp_path, capsys):
    import jax

    from jaxrl.config import ModelConfig
    from jaxrl.models import hf
    from jaxrl.policy.pretrained import load_model

    d, _ = stand_in
    assert main(["convert", "--from-hf", str(d), "--to", str(tmp_path / "conv")]) == 0
    err = capsys.readouterr().err
    assert f"jaxrl: converted {d} (" in err and f"--set model.hf_path={tmp_path / 'conv'}" in err, err
    cfg, params = load_model(ModelConfig(hf_path=str(tmp_path / "conv")))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    assert f"{n_params / 1e6:.2f} M parameters, {cfg.n_layers} layers, d_model {cfg.d_model}" in err, err
    cfg0, params0 = hf.load(d)
    assert cfg.qkv_bias and cfg.vocab_size == cfg0.vocab_size
    jax.tree.map(np.testing.assert_array_equal, params, params0)
    assert main(["convert", "--from-hf", str(d)]) == 2
    assert "give either --from-hf DIR --to DIR" in capsys.readouterr().err
    assert main(["convert", "--from-hf", str(tmp_path), "--to", str(tmp_path / "x")]) == 2
    assert "config.json: not found" in capsys.readouterr().err


MESH_WORKER = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jaxrl.config import MeshConfig
from jaxrl.models import hf
from jaxrl.models.transformer import forward
from jaxrl.policy.resolve import shardings_for
from jaxrl.sharding import parallel_for, make_mesh

assert jax.device_count() == 8
out = {}
# The stand-in has 1 kv head: under tensor=2 its k and v projections (and biases) are replicated, by opt-in.
TP = {"tensor": 2, "allow_replicated": ("blocks/attn/[kv]*",)}
for d, preset, sizes in ((sys.argv[1], "fsdp_tensor", TP), (sys.argv[2], "fsdp_expert", {"expert": 2})):
    cfg, ref = hf.load(d)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (8, 12)))
    want = np.asarray(forward(ref, cfg, tokens, jnp.ones(tokens.shape, bool)))
    mesh, p = make_mesh(MeshConfig(preset=preset, **sizes))
    cfg, params = hf.load(d, shardings_fn=lambda c: shardings_for(c, mesh, p))
    split = sum(not a.sharding.is_fully_replicated for a in jax.tree.leaves(params))
    pairs = zip(jax.tree.leaves(params), jax.tree.leaves(ref))
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs)
    # The MoE checkpoint's experts dispatched expert-parallel over `expert`, as a run's rollout and update do.
    got = np.asarray(forward(params, cfg, tokens, jnp.ones(tokens.shape, bool), parallel_for(mesh, p)))
    out[f"{d}:{preset}"] = {"split": split, "same": same, "diff": float(np.abs(got - want).max())}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_loading_onto_an_8_device_mesh(stand_in, tmp_path, cache_env):
    """One subprocess (XLA_FLAGS must precede jax's import): a dense checkpoint loads under fsdp x tensor
    and an MoE one under fsdp x expert, split, bit-identical to the unsharded load, same logits."""
    d, _ = stand_in
    moe = tmp_path / "moe"
    cfg = transformers.AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
    )
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(moe)
    env = child_env(cache_env, devices=8)
    proc = subprocess.run(
        [sys.executable, "-c", MESH_WORKER, str(d), str(moe)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result) == 2
    for key, r in result.items():
        assert r["same"] and r["diff"] <= 1e-5 and r["split"] > 0, (key, r)


def test_math_jsonl_config_errors_name_the_field(tmp_path):
    from jaxrl.config import ConfigError
    from jaxrl.data.tasks import load_task

    with pytest.raises(ConfigError, match="data.prompt_template: got 'Q:', expected a string containing"):
        load_config(RECIPE, ["data.prompt_template=Q:"])
    with pytest.raises(ConfigError, match="data.train_file: got '', expected a JSONL file"):
        load_config(RECIPE, ["data.train_file="])
    cfg = load_config(RECIPE, [f"data.train_file={tmp_path / 'nope.jsonl'}"])
    with pytest.raises(ConfigError, match="data.train_file: file .*nope.jsonl' not found"):
        load_task(cfg.data, data_dir=str(tmp_path / "tfds"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n{"q": 1}\n')
    cfg = load_config(RECIPE, [f"data.train_file={bad}", "data.test_file="])
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: expected an object with string 'question' and 'answer'"):
        load_task(cfg.data, data_dir=str(tmp_path / "tfds"))
