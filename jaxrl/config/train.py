"""The `train` section: the update loop's steps, epochs, mini- and microbatches, and the update
forward's memory and packing options."""

from __future__ import annotations

import dataclasses

from jaxrl.config.checks import _check

REMAT = ("none", "full", "dots")  # = jaxrl.models.remat.REMAT_POLICIES (a test checks)
PACKING = ("off", "auto", "on")  # = jaxrl.models.packing.PACKING (a test checks)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    seed: int = 0
    ppo_epochs: int = 1
    # Optimizer steps per epoch over the rollout batch, each on 1/minibatches of its rows (DAPO's and
    # verl's mini-batches): with more than one, the later steps are off-policy and ratio clipping acts.
    minibatches: int = 1
    microbatches: int = 1  # per optimizer step; 0: the fewest that fit memory_budget_gib (jaxrl.train.memory_budget)
    # XLA temporaries of the compiled update, for microbatches=0. 0: from the device
    # (jaxrl.train.memory_budget.resolve_budget_gib): a share of what the accelerator reports, 2 GiB on CPU.
    memory_budget_gib: float = 0.0
    # The update forward's memory options (jaxrl.models.transformer.token_logprobs): the LM head and
    # log-softmax on logits_chunk (row, position) pairs at a time (0: all at once), and what each
    # layer keeps for the backward (remat: none | full | dots, or auto: remat and logits chunking
    # chosen from memory_budget_gib, jaxrl.train.memory_budget; none where the budget is CPU's stand-in).
    logits_chunk: int = 0
    remat: str = "auto"
    eval_every: int = 20
    eval_prompts: int = 200
    log_every: int = 1
    progress: bool = True
    # MoE only: the update forward uses the experts the sampler chose for every token (R3 / ESRL).
    routing_replay: bool = True
    # Dense models: the update forwards each group's prompt once for its G rows (same results, less
    # work), wherever the batch's rows are guaranteed to be contiguous groups with one prompt: the
    # static sampler's rollouts, with microbatches of whole groups. Elsewhere (the slot engine, agent
    # episodes, MoE) the update runs the one-pass forward whatever this says (programs.prompt_groups).
    share_prefix: bool = True
    # Dense models: the update's forwards on the live tokens packed into sequences of pack_len slots
    # (0: one padded row's width) instead of the padded B x (P + T) rows (jaxrl.models.packing): "on"
    # always, "auto" where the shared-prefix forward does not run or the prompt is narrower than the
    # completion, "off" never. pack_budget: the packs' slots as a share of the padded slots; a
    # microbatch whose rows do not fit runs unpacked (metric packing/fallback). pack_sizes: how many
    # pack counts are compiled (budget x k / pack_sizes, k = 1..pack_sizes); the smallest that fits runs.
    # The defaults are the long-tail task's measured best (benchmarks/README.md, "Packed updates"): its
    # batches hold 29-72% live slots (99th percentile 65%), and 4 counts up to 0.68 gave 1.59x.
    packing: str = "off"
    pack_len: int = 0
    pack_budget: float = 0.68
    pack_sizes: int = 4

    def validate(self, prefix: str = "train") -> None:
        _check(self.steps >= 0, f"{prefix}.steps", "a non-negative integer", self.steps)
        _check(self.ppo_epochs > 0, f"{prefix}.ppo_epochs", "a positive integer", self.ppo_epochs)
        _check(self.minibatches > 0, f"{prefix}.minibatches", "a positive integer", self.minibatches)
        _check(
            self.microbatches >= 0,
            f"{prefix}.microbatches",
            "0 (auto, from memory_budget_gib) or a positive integer",
            self.microbatches,
        )
        _check(
            self.memory_budget_gib >= 0,
            f"{prefix}.memory_budget_gib",
            "0 (from the device) or a positive number of GiB",
            self.memory_budget_gib,
        )
        _check(
            self.logits_chunk >= 0, f"{prefix}.logits_chunk", "0 (unchunked) or a positive integer", self.logits_chunk
        )
        _check(self.remat in (*REMAT, "auto"), f"{prefix}.remat", " or ".join(map(repr, (*REMAT, "auto"))), self.remat)
        _check(
            self.eval_every >= 0,
            f"{prefix}.eval_every",
            "a non-negative integer (0 = only at the end)",
            self.eval_every,
        )
        _check(self.eval_prompts > 0, f"{prefix}.eval_prompts", "a positive integer", self.eval_prompts)
        _check(self.log_every > 0, f"{prefix}.log_every", "a positive integer", self.log_every)
        _check(self.packing in PACKING, f"{prefix}.packing", " or ".join(map(repr, PACKING)), self.packing)
        _check(self.pack_len >= 0, f"{prefix}.pack_len", "0 (one padded row) or a positive integer", self.pack_len)
        _check(0 < self.pack_budget <= 1, f"{prefix}.pack_budget", "a share in (0, 1]", self.pack_budget)
        _check(self.pack_sizes > 0, f"{prefix}.pack_sizes", "a positive integer", self.pack_sizes)
