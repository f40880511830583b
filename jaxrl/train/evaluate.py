"""Held-out accuracy: greedy completions of the first N test prompts, scored by the task verifier.

The pieces are shared with `jaxrl eval` (jaxrl.eval.run): `encode_records` (the prompts that fit),
`make_chunk_sampler` (the jitted sampler, greedy or not, G completions per prompt) and
`sample_in_chunks` (fixed-shape chunks of prompts, the last one padded, so it compiles once).
On several devices each chunk's rows are split over the run's batch axes (`Parallel`): every device
decodes its share, each process feeds and reads its own rows, and process 0 scores.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.config import Config, ConfigError, ModelConfig
from jaxrl.data.tokenizer import encode_prompts
from jaxrl.models.parallel import Parallel, rows_axis
from jaxrl.multihost import from_primary, gather_rows, local_rows, process_rows, put_rows
from jaxrl.rollout.sampler import SampleOutput, SamplingParams, sample
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
    parallel: Parallel | None = None,
) -> Callable:
    """jit(sample): (params, prompt_BxP, prompt_mask_BxP, rng) -> SampleOutput with G rows per prompt,
    drawn as the rollout draws them (rollout.max_new_tokens, top_k, top_p; greedy ignores the last two).

    `parallel` (the run's `sharding.parallel_for(mesh, preset)`, None on one device): the prompts' and
    the completions' rows split over its batch axes, so each device decodes its share of the chunk
    (B must divide over them: `sample_in_chunks` pads), every other dimension of the outputs
    replicated (each process reads its own rows, `multihost.local_rows`); MoE layers dispatch as the
    rollout's."""
    rc = cfg.rollout
    draw = functools.partial(
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
    )
    if parallel is None:
        return jax.jit(draw)
    rows_sh = rows_sharding(parallel)

    def split(params, prompt_BxP, prompt_mask_BxP, rng):
        prompt_BxP, prompt_mask_BxP = (
            jax.lax.with_sharding_constraint(a, rows_sh) for a in (prompt_BxP, prompt_mask_BxP)
        )
        return draw(params, prompt_BxP=prompt_BxP, prompt_mask_BxP=prompt_mask_BxP, rng=rng)

    rep = NamedSharding(parallel.mesh, P())
    axes = {f: rows_axis(f) for f in SampleOutput._fields}
    out_sh = SampleOutput._make(rep if a is None else rows_sharding(parallel, a) for a in axes.values())
    if not model_cfg.n_experts:  # a dense model's output has no routing
        out_sh = out_sh._replace(routing_BxSxLxK=None)
    return jax.jit(split, out_shardings=out_sh)


def rows_sharding(parallel: Parallel, axis: int = 0) -> NamedSharding:
    """Rows (dimension `axis`) split over `parallel`'s batch axes, everything else replicated."""
    return NamedSharding(parallel.mesh, P(*([None] * axis), parallel.batch))


def sample_in_chunks(
    sampler: Callable, params, tok_BxP, mask_BxP, chunk: int, rng, group_size: int, on_chunk=None, parallel=None
):
    """All completions of the B prompts, `chunk` prompts per call: (tokens_NxT, finished_N, length_N) on
    the host of every process, N = B * G, rows i*G .. i*G+G-1 answering prompt i. Chunk c draws with
    fold_in(rng, c); `on_chunk(n_prompts)` after each.

    Every call gets the same number of rows: the chunk, padded to a multiple of `parallel`'s batch
    devices (the sampler's `parallel`), and the last chunk to that too, with copies of the first
    prompt that are dropped before anything reads them. Each process feeds its devices only its own
    rows of a call (`multihost.put_rows`) and reads back its own rows of the completions, which
    `multihost.gather_rows` then puts together on every process (one process: nothing to gather)."""
    n, G = len(tok_BxP), group_size
    n_dev = 1 if parallel is None else parallel.n_rows_devices
    width = chunk + (-chunk) % n_dev  # prompts per call
    sh = None if parallel is None else rows_sharding(parallel)
    here = slice(None) if sh is None else process_rows(sh, width)  # this process's prompt rows of a call

    def feed(x_BxP):
        return x_BxP if sh is None else put_rows(sh, x_BxP[here], width)

    def read(x):
        return np.asarray(x) if sh is None else gather_rows(sh, local_rows(x), width * G)

    def padded(x_BxP, first_1xP):
        return np.concatenate([x_BxP, np.repeat(first_1xP, width - len(x_BxP), 0)])

    tokens, finished, lengths = [], [], []
    for c, i in enumerate(range(0, n, chunk)):
        out = sampler(
            params,
            prompt_BxP=feed(padded(tok_BxP[i : i + chunk], tok_BxP[:1])),
            prompt_mask_BxP=feed(padded(mask_BxP[i : i + chunk], mask_BxP[:1])),
            rng=jax.random.fold_in(rng, c),
        )
        live = min(chunk, n - i) * G  # the rows answering real prompts
        tokens.append(read(out.tokens_BxT)[:live])
        finished.append(read(out.finished_B)[:live])
        lengths.append(read(out.length_B)[:live])
        if on_chunk is not None:
            on_chunk(min(chunk, n - i))
    return np.concatenate(tokens), np.concatenate(finished), np.concatenate(lengths)


def make_evaluator(
    cfg: Config,
    model_cfg: ModelConfig,
    tokenizer,
    records: list[dict],
    verifier,
    parallel: Parallel | None = None,
):
    """Returns evaluate(params, on_chunk=None) -> {'eval/accuracy', 'eval/format', 'eval/response_len'}.

    `parallel` (the run's, None on one device): each chunk's prompts split over its batch axes, each
    device decoding its share (MoE: dispatched as the rollout's). `on_chunk(n)`: called after each
    chunk of n prompts (a progress bar). In a multi-process run every process calls it: each feeds
    and reads its own rows, process 0 scores the completions and every process gets its numbers."""
    records, tok_BxP, mask_BxP = encode_records(cfg, tokenizer, records)
    chunk = min(EVAL_CHUNK, len(records))
    greedy = make_chunk_sampler(cfg, model_cfg, tokenizer, group_size=1, greedy=True, parallel=parallel)
    key = jax.random.key(0)  # unused by greedy decoding, but part of the signature

    def evaluate(params, on_chunk=None) -> dict:
        tokens_BxT, finished_B, length_B = sample_in_chunks(
            greedy, params, tok_BxP, mask_BxP, chunk, key, 1, on_chunk, parallel
        )

        def scored() -> dict:
            rewards_BxK, _ = score_completions(tokens_BxT, finished_B, records, tokenizer=tokenizer, verifier=verifier)
            return {
                "eval/accuracy": float(rewards_BxK[:, 0].mean()),
                "eval/format": float(rewards_BxK[:, 1].mean()),
                "eval/response_len": float(length_B.mean()),
            }

        return from_primary(scored)

    return evaluate
