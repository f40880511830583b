"""Host-side glue between records and arrays: prompt batches and SFT targets."""

from __future__ import annotations

import numpy as np

from jaxrl.config import ConfigError, DataConfig
from jaxrl.data.stream import StreamState, next_batch
from jaxrl.data.tokenizer import encode_prompts


def next_prompts(source, stream: StreamState, n: int, tokenizer, data: DataConfig, seed: int):
    """Take `n` usable prompts from the stream; over-long prompts are skipped (and counted) if the
    config allows it, otherwise they raise naming the record."""
    records, tokens, masks, skipped = [], [], [], 0
    while len(records) < n:
        chunk, stream = next_batch(source, stream, n - len(records), seed)
        tok_BxP, mask_BxP, kept, n_skipped = encode_prompts(
            tokenizer,
            [r["prompt"] for r in chunk],
            data.max_prompt_len,
            skip_long=data.skip_long_prompts,
            record_ids=[r["id"] for r in chunk],
            pad_to=data.max_prompt_len,
        )
        skipped += n_skipped
        if n_skipped == len(chunk) and skipped > 100 * n:
            raise ConfigError(
                f"data.max_prompt_len={data.max_prompt_len}: nearly every prompt is longer; {skipped} skipped"
            )
        records += [chunk[i] for i in kept]
        tokens.append(tok_BxP)
        masks.append(mask_BxP)
    return records, np.concatenate(tokens), np.concatenate(masks), stream, skipped


def completion_targets(tokenizer, answers: list[str], width: int, ids: list[str]):
    """answer + EOS, right-padded to `width`: (tokens_BxT int32, mask_BxT float32) for warm start."""
    tokens = np.full((len(answers), width), tokenizer.pad_id, np.int32)
    mask = np.zeros((len(answers), width), np.float32)
    for i, (a, rid) in enumerate(zip(answers, ids)):
        ids_ = tokenizer.encode(a) + [tokenizer.eos_id]
        if len(ids_) > width:
            raise ConfigError(
                f"rollout.max_new_tokens={width}: the answer of record {rid!r} needs {len(ids_)} tokens with EOS"
            )
        tokens[i, : len(ids_)] = ids_
        mask[i, : len(ids_)] = 1.0
    return tokens, mask
