"""What a rollout hands the update: `RolloutBatch`, one row per completion (numpy, this process's rows).

Every source builds it here: the static sampler with the constructor (rows i*G .. i*G+G-1 answer prompt
i, no `group_id_B`), the slot engine and the episode engine with `from_groups` (rows of group i
contiguous, `group_id_B` = i). The update takes `batch.fields()`, a dict by field name; field names
carry their shapes (B rows, P prompt width, T completion width, K reward parts, S = P + T, L layers),
which is how jaxrl.sharding lays each field out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class RolloutBatch(NamedTuple):
    """The update's fields; None: not part of this batch."""

    prompt_tokens_BxP: np.ndarray  # int32, left-padded
    prompt_mask_BxP: np.ndarray
    tokens_BxT: np.ndarray  # int32; pad after each completion's last token
    completion_mask_BxT: np.ndarray  # float32: 1 on the tokens the loss sees (an episode's model tokens)
    rollout_logp_BxT: np.ndarray  # float32: log-prob each token was drawn with, 0 where masked
    truncated_B: np.ndarray  # float32: 1 = stopped by a limit (no EOS)
    rewards_BxK: np.ndarray | None = None  # float32, columns jaxrl.data.rewards.REWARD_NAMES; None until scored
    group_id_B: np.ndarray | None = None  # int32; None: groups of rollout.group_size rows in order
    stale_BxT: np.ndarray | None = None  # float32: 1 on tokens an older policy version drew
    version_BxT: np.ndarray | None = None  # int32, the engine's: the version that drew each token, -1 where masked
    routing_BxSxLxK: np.ndarray | None = None  # MoE: the experts each position used, replayed in the update

    def fields(self) -> dict:
        """The batch by field name, without the fields it does not carry."""
        return {k: v for k, v in self._asdict().items() if v is not None}

    def with_staleness(self, version: int) -> RolloutBatch:
        """`version_BxT` -> `stale_BxT` against the step's policy `version` (1 on tokens an older one drew)."""
        assert self.version_BxT is not None, "with_staleness: the batch has no version_BxT"
        v = self.version_BxT
        return self._replace(stale_BxT=((v >= 0) & (v < version)).astype(np.float32), version_BxT=None)

    @classmethod
    def from_groups(
        cls,
        groups: Sequence,
        masks_GxT: Sequence[np.ndarray],
        truncated_G: Sequence[np.ndarray],
        *,
        versions_GxT: Sequence[np.ndarray] | None = None,
        routing_GxSxLxK: Sequence | None = None,
    ) -> RolloutBatch:
        """Groups of samples (each with prompt_P, prompt_mask_P, tokens_GxT, logp_GxT), with each group's
        loss mask and truncation flags, and optionally the versions that drew its tokens and its MoE
        routing, -> the batch: group i's rows contiguous, group_id_B = i."""
        if not groups:
            raise ValueError("RolloutBatch.from_groups: no groups")
        sizes = [len(g.tokens_GxT) for g in groups]

        def cat(f):
            return np.concatenate([f(g) for g in groups])

        return cls(
            prompt_tokens_BxP=cat(lambda g: np.repeat(g.prompt_P[None], len(g.tokens_GxT), 0)),
            prompt_mask_BxP=cat(lambda g: np.repeat(g.prompt_mask_P[None], len(g.tokens_GxT), 0)),
            tokens_BxT=cat(lambda g: g.tokens_GxT),
            completion_mask_BxT=np.concatenate(masks_GxT).astype(np.float32),
            rollout_logp_BxT=cat(lambda g: g.logp_GxT).astype(np.float32),
            truncated_B=np.concatenate(truncated_G).astype(np.float32),
            group_id_B=np.repeat(np.arange(len(groups), dtype=np.int32), sizes),
            version_BxT=None if versions_GxT is None else np.concatenate(versions_GxT),
            routing_BxSxLxK=None if routing_GxSxLxK is None else np.concatenate(routing_GxSxLxK),
        )
