"""Held-out accuracy: greedy completions of the first N test prompts, scored by the task verifier."""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxrl.config import Config, ConfigError, ModelConfig
from jaxrl.data.rewards import score
from jaxrl.data.tokenizer import encode_prompts
from jaxrl.rollout.sampler import sample
from jaxrl.train.batching import decode_completions, prompt_width

EVAL_CHUNK = 100  # prompts per jitted call; the last chunk is padded so the shape never changes


def eval_records(cfg: Config, test_source) -> list[dict]:
    n = cfg.train.eval_prompts
    if n > len(test_source):
        raise ConfigError(
            f"train.eval_prompts={n} exceeds the {len(test_source)} records of the test split (data.num_test)"
        )
    return [test_source[i] for i in range(n)]


def make_evaluator(cfg: Config, model_cfg: ModelConfig, tokenizer, records: list[dict], verifier, out_sharding=None):
    """Returns evaluate(params) -> {'eval/accuracy', 'eval/format', 'eval/response_len'}.

    `out_sharding` (e.g. replicated over the mesh): where the completions land, so that every process
    of a multi-process run can read them whatever the params' layout."""
    tok_BxP, mask_BxP, kept, _ = encode_prompts(
        tokenizer,
        [r["prompt"] for r in records],
        cfg.data.max_prompt_len,
        skip_long=cfg.data.skip_long_prompts,
        record_ids=[r["id"] for r in records],
        pad_to=prompt_width(cfg.data),
    )
    if not kept:
        raise ConfigError(
            f"every one of the {len(records)} eval prompts (train.eval_prompts) is longer than "
            f"data.max_prompt_len={cfg.data.max_prompt_len} tokens and was skipped "
            f"(data.skip_long_prompts): raise data.max_prompt_len"
        )
    records = [records[i] for i in kept]
    chunk = min(EVAL_CHUNK, len(records))
    pad = (-len(records)) % chunk
    tok_BxP = np.concatenate([tok_BxP, np.repeat(tok_BxP[:1], pad, 0)])
    mask_BxP = np.concatenate([mask_BxP, np.repeat(mask_BxP[:1], pad, 0)])
    greedy = jax.jit(
        functools.partial(
            sample,
            cfg=model_cfg,
            group_size=1,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
            greedy=True,
        ),
        **({} if out_sharding is None else {"out_shardings": out_sharding}),
    )
    key = jax.random.key(0)  # unused by greedy decoding, but part of the signature

    def evaluate(params) -> dict:
        tokens, finished, lengths = [], [], []
        for i in range(0, len(tok_BxP), chunk):
            out = greedy(params, prompt_BxP=tok_BxP[i : i + chunk], prompt_mask_BxP=mask_BxP[i : i + chunk], rng=key)
            tokens.append(np.asarray(out.tokens_BxT))
            finished.append(np.asarray(out.finished_B))
            lengths.append(np.asarray(out.length_B))
        n = len(records)
        texts = decode_completions(tokenizer, np.concatenate(tokens)[:n])
        rewards_BxK, _ = score(verifier, texts, list(np.concatenate(finished)[:n]), records)
        return {
            "eval/accuracy": float(rewards_BxK[:, 0].mean()),
            "eval/format": float(rewards_BxK[:, 1].mean()),
            "eval/response_len": float(np.concatenate(lengths)[:n].mean()),
        }

    return evaluate
