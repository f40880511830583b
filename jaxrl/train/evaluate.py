"""Held-out accuracy: greedy completions of the first N test prompts, scored by the task verifier.

The pieces are shared with `jaxrl eval` (jaxrl.eval.run): `encode_records` (the prompts that fit),
`make_chunk_sampler` (the jitted sampler, greedy or not, G completions per prompt) and
`sample_in_chunks` (fixed-shape chunks of prompts, the last one padded, so it compiles once).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import numpy as np

from jaxrl.config import Config, ConfigError, ModelConfig
from jaxrl.data.tokenizer import encode_prompts
from jaxrl.models.parallel import Parallel
from jaxrl.rollout.sampler import SamplingParams, sample
from jaxrl.sources.scoring import score_completions

EVAL_CHUNK = 100  # prompts per jitted call; the last chunk is padded so the shape never changes


def eval_records(cfg: Config, test_source) -> list[dict]:
    n = cfg.train.eval_prompts
    if n > len(test_source):
        raise ConfigError(
            f"train.eval_prompts={n} exceeds the {len(test_source)} records of the test split (data.num_test)"
        )
    return [test_source[i] for i in range(n)]


def encode_records(cfg: Config, tokenizer, records: list[dict], what: str = "eval prompts (train.eval_prompts)"):
    """(the records whose prompts fit, their left-padded tokens_BxP, mask_BxP); a ConfigError naming
    data.max_prompt_len when none fits."""
    tok_BxP, mask_BxP, kept, _ = encode_prompts(
        tokenizer,
        [r["prompt"] for r in records],
        cfg.data.max_prompt_len,
        skip_long=cfg.data.skip_long_prompts,
        record_ids=[r["id"] for r in records],
        pad_to=cfg.data.max_prompt_len,
    )
    if not kept:
        raise ConfigError(
            f"every one of the {len(records)} {what} is longer than "
            f"data.max_prompt_len={cfg.data.max_prompt_len} tokens and was skipped "
            f"(data.skip_long_prompts): raise data.max_prompt_len"
        )
    return [records[i] for i in kept], tok_BxP, mask_BxP


def make_chunk_sampler(
    cfg: Config,
    model_cfg: ModelConfig,
    tokenizer,
    *,
    group_size: int,
    greedy: bool,
    temperature: float = 1.0,
    out_sharding=None,
    parallel: Parallel | None = None,
) -> Callable:
    """jit(sample): (params, prompt_BxP, prompt_mask_BxP, rng) -> SampleOutput with G rows per prompt,
    drawn as the rollout draws them (rollout.max_new_tokens, top_k, top_p; greedy ignores the last two;
    MoE: `parallel`, the run's `sharding.parallel_for(mesh, preset)`, as the rollout's)."""
    rc = cfg.rollout
    return jax.jit(
        functools.partial(
            sample,
            cfg=model_cfg,
            sampling=SamplingParams(
                temperature=temperature,
                top_k=0 if greedy else rc.top_k,
                top_p=1.0 if greedy else rc.top_p,
                greedy=greedy,
                max_new_tokens=rc.max_new_tokens,
                eos_id=tokenizer.eos_id,
                pad_id=tokenizer.pad_id,
            ),
            group_size=group_size,
            parallel=parallel,
        ),
        **({} if out_sharding is None else {"out_shardings": out_sharding}),
    )


def sample_in_chunks(sampler: Callable, params, tok_BxP, mask_BxP, chunk: int, rng, group_size: int, on_chunk=None):
    """All completions of the B prompts, `chunk` prompts per call (the last chunk padded with copies of
    the first prompt, then dropped): (tokens_NxT, finished_N, length_N) on the host, N = B * G, rows
    i*G .. i*G+G-1 answering prompt i. Chunk c draws with fold_in(rng, c); `on_chunk(n_prompts)` after each."""
    n = len(tok_BxP)
    pad = (-n) % chunk
    tok_BxP = np.concatenate([tok_BxP, np.repeat(tok_BxP[:1], pad, 0)])
    mask_BxP = np.concatenate([mask_BxP, np.repeat(mask_BxP[:1], pad, 0)])
    tokens, finished, lengths = [], [], []
    for c, i in enumerate(range(0, len(tok_BxP), chunk)):
        out = sampler(
            params,
            prompt_BxP=tok_BxP[i : i + chunk],
            prompt_mask_BxP=mask_BxP[i : i + chunk],
            rng=jax.random.fold_in(rng, c),
        )
        tokens.append(np.asarray(out.tokens_BxT))
        finished.append(np.asarray(out.finished_B))
        lengths.append(np.asarray(out.length_B))
        if on_chunk is not None:
            on_chunk(min(chunk, n - i))
    rows = n * group_size
    return np.concatenate(tokens)[:rows], np.concatenate(finished)[:rows], np.concatenate(lengths)[:rows]


def make_evaluator(
    cfg: Config,
    model_cfg: ModelConfig,
    tokenizer,
    records: list[dict],
    verifier,
    out_sharding=None,
    parallel: Parallel | None = None,
):
    """Returns evaluate(params, on_chunk=None) -> {'eval/accuracy', 'eval/format', 'eval/response_len'}.

    `out_sharding` (e.g. replicated over the mesh): where the completions land, so that every process
    of a multi-process run can read them whatever the params' layout. `on_chunk(n)`: called after each
    chunk of n prompts (a progress bar). `parallel` (MoE): the experts' mesh axis, as the rollout's."""
    records, tok_BxP, mask_BxP = encode_records(cfg, tokenizer, records)
    chunk = min(EVAL_CHUNK, len(records))
    greedy = make_chunk_sampler(
        cfg, model_cfg, tokenizer, group_size=1, greedy=True, out_sharding=out_sharding, parallel=parallel
    )
    key = jax.random.key(0)  # unused by greedy decoding, but part of the signature

    def evaluate(params, on_chunk=None) -> dict:
        tokens_BxT, finished_B, length_B = sample_in_chunks(greedy, params, tok_BxP, mask_BxP, chunk, key, 1, on_chunk)
        rewards_BxK, _ = score_completions(tokens_BxT, finished_B, records, tokenizer=tokenizer, verifier=verifier)
        return {
            "eval/accuracy": float(rewards_BxK[:, 0].mean()),
            "eval/format": float(rewards_BxK[:, 1].mean()),
            "eval/response_len": float(length_B.mean()),
        }

    return evaluate
