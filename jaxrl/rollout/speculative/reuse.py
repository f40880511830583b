"""Host side of speculative rollouts in training: the store of previous completions that trajectory
reuse drafts from, and the per-rollout metrics.

The store is explicit host state of the train loop: the latest G completions of every prompt seen
(keyed by the prompt's real tokens), least recently used prompts dropped past `max_prompts`. Every
process holds the whole store (the loop gathers all rows before `update`). It is checkpointed with
the run (`to_state` / `from_state`, a compressed npz in a JSON string), so a resumed run drafts from
exactly the completions an uninterrupted one would, and takes the same speculative steps.
"""

from __future__ import annotations

import base64
import collections
import io

import numpy as np


class DraftStore:
    def __init__(self, max_prompts: int = 100_000):
        self.max_prompts = max_prompts
        self._table: collections.OrderedDict = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    @staticmethod
    def _key(prompt_P, mask_P) -> bytes:
        return np.asarray(prompt_P, np.int32)[np.asarray(mask_P, bool)].tobytes()

    def lookup(self, prompt_BxP, mask_BxP, group_size: int, max_new_tokens: int, pad_id: int):
        """-> (draft_NxT int32, draft_len_N int32 (0: none), draft_logp_NxT float32) for the N = B*G
        output rows (row i*G + g drafts from completion g of prompt i's last rollout)."""
        B, G, T = len(prompt_BxP), group_size, max_new_tokens
        draft = np.full((B * G, T), pad_id, np.int32)
        length = np.zeros((B * G,), np.int32)
        logp = np.zeros((B * G, T), np.float32)
        for i in range(B):
            hit = self._table.get(self._key(prompt_BxP[i], mask_BxP[i]))
            if hit is None:
                continue
            self._table.move_to_end(self._key(prompt_BxP[i], mask_BxP[i]))
            tokens, lens, lps = hit
            n, t = min(G, len(tokens)), min(T, tokens.shape[1])
            rows = slice(i * G, i * G + n)
            draft[rows, :t], length[rows], logp[rows, :t] = tokens[:n, :t], np.minimum(lens[:n], t), lps[:n, :t]
        return draft, length, logp

    def to_state(self) -> str:
        """The whole store, in LRU order, as a JSON-able string (base64 of a compressed npz). Entries
        of one run all have G rows of T tokens, so they are stacked."""
        keys = [np.frombuffer(k, np.int32) for k in self._table]
        key_NxK = np.full((len(keys), max((len(k) for k in keys), default=0)), -1, np.int32)
        for i, k in enumerate(keys):
            key_NxK[i, : len(k)] = k
        arrays = {
            "max_prompts": np.int64(self.max_prompts),
            "key_NxK": key_NxK,
            "key_len_N": np.asarray([len(k) for k in keys], np.int32),
        }
        if self._table:
            tokens, length, logp = zip(*self._table.values())
            arrays.update(tokens_NxGxT=np.stack(tokens), length_NxG=np.stack(length), logp_NxGxT=np.stack(logp))
        buf = io.BytesIO()
        np.savez_compressed(buf, **arrays)
        return base64.b64encode(buf.getvalue()).decode("ascii")

    @classmethod
    def from_state(cls, state: str) -> DraftStore:
        """Inverse of `to_state`: the same entries in the same LRU order."""
        with np.load(io.BytesIO(base64.b64decode(state))) as z:
            z = {k: z[k] for k in z.files}  # each access of an NpzFile reads (and inflates) again
        store = cls(int(z["max_prompts"]))
        for i, (key_K, n) in enumerate(zip(z["key_NxK"], z["key_len_N"])):
            store._table[key_K[:n].tobytes()] = (z["tokens_NxGxT"][i], z["length_NxG"][i], z["logp_NxGxT"][i])
        return store

    def update(self, prompt_BxP, mask_BxP, tokens_NxT, length_N, logp_NxT, group_size: int) -> None:
        G = group_size
        for i in range(len(prompt_BxP)):
            rows = slice(i * G, (i + 1) * G)
            key = self._key(prompt_BxP[i], mask_BxP[i])
            self._table[key] = (
                np.asarray(tokens_NxT[rows], np.int32),
                np.asarray(length_N[rows], np.int32),
                np.asarray(logp_NxT[rows], np.float32),
            )
            self._table.move_to_end(key)
        while len(self._table) > self.max_prompts:
            self._table.popitem(last=False)


def spec_metrics(stats) -> dict:
    """SpecStats (device scalars) -> the logged `spec/*` metrics."""
    s = {k: float(v) for k, v in stats._asdict().items()}
    steps = s["self_steps"] + s["reuse_steps"] + s["plain_steps"]
    return {
        "spec/acceptance_rate": s["accepted"] / s["drafted"] if s["drafted"] else None,
        "spec/accepted_per_verification": s["accepted"] / s["row_verifications"] if s["row_verifications"] else None,
        "spec/draft_len": s["draft_len_sum"] / s["self_steps"] if s["self_steps"] else None,
        "spec/speculated_frac": (s["self_steps"] + s["reuse_steps"]) / steps if steps else 0.0,
        "spec/acceptance_estimate": s["acceptance"],
        "spec/reuse_acceptance_estimate": s["reuse_acceptance"],
    }
