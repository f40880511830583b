"""Build a tiny stand-in for Qwen2.5-0.5B-Instruct and a GSM8K-style JSONL, to try the GPU recipe
(configs/qwen2.5_0.5b_gsm8k_grpo.py) on CPU in a minute; nothing is downloaded.

    python scripts/make_stand_in.py OUT      # then run the `jaxrl train` line it prints

OUT/qwen_tiny: a random 2-layer Qwen2 (hidden 32, vocabulary 320) written by jaxrl's own exporter, with a
byte-level BPE tokenizer trained on the problems (ChatML special tokens, EOS <|im_end|>, PAD
<|endoftext|>) and Qwen2.5's chat template as chat_template.jinja: the builders of tests/hf_stand_in.py,
as the tests use them. OUT/gsm8k_train.jsonl, OUT/gsm8k_test.jsonl: addition word problems with
"#### <answer>". Needs the `hf` extra (`tokenizers`), not torch. The policy is random: the run shows
the recipe's machinery working (loading, rollout, rewards, update, eval, checkpoints), not learning.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import shlex
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # hf_stand_in: the tests' stand-in builders

from hf_stand_in import CHATML_SPECIALS, QWEN25, save_bpe_tokenizer  # noqa: E402

from jaxrl.config import ConfigError, ModelConfig  # noqa: E402
from jaxrl.data.hf_tokenizer import HF_EXTRA  # noqa: E402

RECIPE = "configs/qwen2.5_0.5b_gsm8k_grpo.py"
VOCAB = 320  # the model's rows; the tokenizer uses the first ~300
# The recipe at CPU size: float32 on one device, 2 prompts x 2 completions of 24 tokens, 3 steps.
CPU_SETS = (
    "model.dtype=float32",
    "mesh.preset=single",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=24",
    "train.steps=3",
    "train.microbatches=1",
    "train.eval_every=3",
    "train.eval_prompts=4",
    "checkpoint.every=3",
)


def problems(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        name, thing = rng.choice(["Natalia", "Weng", "Betty", "James"]), rng.choice(["clips", "apples", "pages"])
        question = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?"
        out.append({"question": question, "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
    return out


def build(out: pathlib.Path) -> list[str]:
    """Write the checkpoint and the data under `out`; -> the `jaxrl train` argv that runs the recipe on them."""
    import jax

    from jaxrl.models import hf
    from jaxrl.models.transformer import init_params

    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise ConfigError(f"the stand-in's tokenizer needs the `tokenizers` package: {HF_EXTRA}") from None
    train, test = problems(64, 0), problems(16, 1)
    for name, rows in (("gsm8k_train.jsonl", train), ("gsm8k_test.jsonl", test)):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    d = out / "qwen_tiny"
    d.mkdir(parents=True, exist_ok=True)
    prompt_text = ["<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"]
    corpus = [r["question"] + " " + r["answer"] for r in train] * 5 + prompt_text * 5
    tokens = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    save_bpe_tokenizer(d, corpus, 300, CHATML_SPECIALS, tokens)
    (d / "chat_template.jinja").write_text(QWEN25)  # where transformers 5 keeps it
    cfg = ModelConfig(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
        qkv_bias=True, tie_embeddings=True, max_seq_len=32768,
    )  # fmt: skip
    params = init_params(cfg, jax.random.key(0))
    eos, pad = CHATML_SPECIALS.index("<|im_end|>"), CHATML_SPECIALS.index("<|endoftext|>")
    hf.save(d, params, cfg, eos_token_id=eos, pad_token_id=pad)
    sets = [f"model.hf_path={d}", f"data.train_file={out / 'gsm8k_train.jsonl'}"]
    sets += [f"data.test_file={out / 'gsm8k_test.jsonl'}", *CPU_SETS]
    return ["jaxrl", "train", RECIPE, *(w for s in sets for w in ("--set", s)), "--workdir", str(out / "run")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", help="a new directory for the checkpoint (OUT/qwen_tiny), the data and the run")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out).absolute()
    if (out / "qwen_tiny").exists():
        print(f"make_stand_in.py: error: {out / 'qwen_tiny'} exists; choose a new OUT", file=sys.stderr)
        return 2
    try:
        command = build(out)
    except ConfigError as e:
        print(f"make_stand_in.py: error: {e}", file=sys.stderr)
        return 2
    print(f"make_stand_in.py: wrote {out / 'qwen_tiny'} and {out}/gsm8k_{{train,test}}.jsonl; run the recipe on "
          "them (from the repository root) with:", file=sys.stderr)  # fmt: skip
    print(shlex.join(command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
