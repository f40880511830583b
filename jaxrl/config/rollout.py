"""Config sections of the rollout: `RolloutConfig` with its `speculative` and `engine` parts
(re-exported by `jaxrl.config`)."""

from __future__ import annotations

import dataclasses

from jaxrl.config.checks import _check


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative rollouts (jaxrl.rollout.speculative.sample): same sampled distribution, fewer policy steps.

    drafter: early_exit (the policy's first `draft_layers` blocks), int8 (the policy with int8
    weights), or reuse (the previous completion of the same prompt, verified as a point mass; rows
    without one use the self-drafter `fallback`, or plain decoding when it is "none").
    With rollout.engine.enabled only early_exit is available (jaxrl.rollout.speculative.engine: a
    fixed draft length of max_draft; adaptive, calibrate and the costs are unused there), and the
    engine speculates only once max_active_rows or fewer slots decode (the tail), on those rows
    only; `calibrate.tail_threshold` derives that row count from measured costs and acceptance.
    """

    enabled: bool = False
    drafter: str = "early_exit"  # early_exit | int8 | reuse
    draft_layers: int = 1  # early_exit: blocks the drafter runs
    max_draft: int = 4  # most tokens drafted per verification (the verify forward's static width - 1)
    adaptive: bool = True  # pick the draft length from the measured acceptance (else always max_draft)
    # Costs relative to one plain decode step, for the adaptive choice: a verify forward and each
    # drafted token. calibrate=True times both on this machine for the rollout's shape before the
    # first rollout (rollout/calibrate.py) and the constants below are unused; 1.0 / 0.5 suit
    # memory-bound decoding (accelerators, big models). On a small CPU a verify costs far more
    # (benchmarks/README.md), and the measured costs then keep speculation off where it would lose.
    calibrate: bool = True
    verify_cost: float = 1.0
    draft_cost: float = 0.5
    initial_acceptance: float = 0.7  # the acceptance estimate before any is measured
    max_active_rows: int = 1024  # speculate only while at most this many rows are still decoding
    # Engine only: the early-exit drafter's head covers only the draft_vocab most frequent token ids
    # (jaxrl/rollout/speculative/draft_vocab.py; the training loop ranks them over the task's training prompts,
    # EOS first); 0 = the full vocabulary. Samples keep their exact distribution either way.
    draft_vocab: int = 0
    # adaptive: a rollout that the costs and acceptance estimates say cannot gain runs the plain
    # sampler instead; every probe_every-th rollout speculates anyway, to re-measure acceptance.
    probe_every: int = 10
    reuse_width: int = 8  # reuse: drafted tokens verified per forward
    reuse_rule: str = "exact"  # reuse: exact (point-mass rejection) | spec_rl (APPROXIMATE: min(1, p/q_old))
    fallback: str = "none"  # reuse: self-drafter for rows without a live reused draft (none | early_exit | int8)

    def validate(self, prefix: str = "rollout.speculative") -> None:
        _check(
            self.drafter in ("early_exit", "int8", "reuse"),
            f"{prefix}.drafter",
            "'early_exit', 'int8' or 'reuse'",
            self.drafter,
        )
        _check(self.draft_layers > 0, f"{prefix}.draft_layers", "a positive integer", self.draft_layers)
        _check(self.max_draft > 0, f"{prefix}.max_draft", "a positive integer", self.max_draft)
        _check(self.draft_cost > 0, f"{prefix}.draft_cost", "a positive number", self.draft_cost)
        _check(self.verify_cost > 0, f"{prefix}.verify_cost", "a positive number", self.verify_cost)
        _check(
            0 < self.initial_acceptance < 1,
            f"{prefix}.initial_acceptance",
            "a number in (0, 1)",
            self.initial_acceptance,
        )
        _check(self.max_active_rows > 0, f"{prefix}.max_active_rows", "a positive integer", self.max_active_rows)
        _check(
            self.draft_vocab >= 0,
            f"{prefix}.draft_vocab",
            "0 (the full vocabulary) or a positive integer",
            self.draft_vocab,
        )
        _check(self.probe_every > 0, f"{prefix}.probe_every", "a positive integer", self.probe_every)
        _check(self.reuse_width > 0, f"{prefix}.reuse_width", "a positive integer", self.reuse_width)
        _check(self.reuse_rule in ("exact", "spec_rl"), f"{prefix}.reuse_rule", "'exact' or 'spec_rl'", self.reuse_rule)
        _check(
            self.fallback in ("none", "early_exit", "int8"),
            f"{prefix}.fallback",
            "'none', 'early_exit' or 'int8'",
            self.fallback,
        )


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The slot-based decode engine (jaxrl.rollout.engine.driver): samples with lifecycles instead of one
    static B x T call. `slots` samples decode at once; between chunks of `chunk` decode steps the
    host retires finished samples and admits new groups (`admit_groups` prompts per prefill call).
    admission: exact (admit only the groups a collect still needs: no sample outlives its collect)
    | fill (keep every free slot busy: unfinished samples stay in their slots for the next collect).
    max_staleness (fill only; -1 = no bound): how many versions older than the collect's version a
    returned sample's first token may be. A group that would break it (in flight, or complete and
    waiting) is restarted whole from its prompt; 0 = no sample spans an update.
    reprefill: at a version change, recompute the KV caches of the samples carried over (prompt +
    tokens so far) under the new params before they continue; their drawn tokens keep their
    recorded log-probs and versions."""

    enabled: bool = False
    slots: int = 64
    chunk: int = 8
    admit_groups: int = 4
    admission: str = "exact"  # exact | fill
    max_staleness: int = -1  # -1: unbounded; else the most versions a returned sample's first token may lag
    reprefill: bool = False  # recompute carried samples' caches under new params at a version change
    # Which groups and prompts a step uses (jaxrl/sources/filters.py, prompt_filter.py):
    # dynamic_sampling (DAPO) drops groups whose combined rewards are all equal and draws up to
    # max_extra_groups more per step to replace them; prompt_filter=beta (DEPO/HIVE) skips a prompt
    # when a Thompson draw from its Beta(filter_prior + successes/failures) lies outside
    # [filter_low, filter_high].
    dynamic_sampling: bool = False
    max_extra_groups: int = 64
    prompt_filter: str = "none"  # none | beta
    filter_low: float = 0.05
    filter_high: float = 0.95
    filter_prior: tuple = (1.0, 1.0)  # Beta(a, b) for a prompt never scored
    # allocation=vigor (jaxrl.sources.allocation): every prompt starts with initial_samples samples;
    # the rest of the step's prompts_per_step * group_size samples go, over allocation_rounds rounds,
    # to the prompts whose rewards vary most, at most max_group_samples each (0: 2 * group_size).
    allocation: str = "uniform"  # uniform | vigor
    initial_samples: int = 2
    allocation_rounds: int = 2
    max_group_samples: int = 0

    def validate(self, prefix: str = "rollout.engine") -> None:
        _check(self.slots > 0, f"{prefix}.slots", "a positive integer", self.slots)
        _check(self.chunk > 0, f"{prefix}.chunk", "a positive integer (decode steps between admissions)", self.chunk)
        _check(self.admit_groups > 0, f"{prefix}.admit_groups", "a positive integer", self.admit_groups)
        _check(self.admission in ("exact", "fill"), f"{prefix}.admission", "'exact' or 'fill'", self.admission)
        _check(
            self.max_staleness >= -1, f"{prefix}.max_staleness", "-1 (no bound) or an integer >= 0", self.max_staleness
        )
        _check(
            self.max_extra_groups >= 0, f"{prefix}.max_extra_groups", "0 or a positive integer", self.max_extra_groups
        )
        _check(
            self.prompt_filter in ("none", "beta"), f"{prefix}.prompt_filter", "'none' or 'beta'", self.prompt_filter
        )
        _check(
            0 <= self.filter_low < self.filter_high <= 1,
            f"{prefix}.filter_low/filter_high",
            "0 <= filter_low < filter_high <= 1",
            (self.filter_low, self.filter_high),
        )
        _check(
            len(self.filter_prior) == 2 and min(self.filter_prior) > 0,
            f"{prefix}.filter_prior",
            "two positive numbers (a, b)",
            self.filter_prior,
        )
        _check(self.allocation in ("uniform", "vigor"), f"{prefix}.allocation", "'uniform' or 'vigor'", self.allocation)
        _check(self.allocation_rounds > 0, f"{prefix}.allocation_rounds", "a positive integer", self.allocation_rounds)

    def check_allocation(self, group_size: int, prefix: str = "rollout.engine") -> None:
        """allocation=vigor against the group size: n0 < G <= cap, and synchronous admission."""
        if self.allocation != "vigor":
            return
        _check(
            self.enabled,
            f"{prefix}.allocation",
            "'uniform' unless rollout.engine.enabled=true (vigor allocates the engine's samples)",
            self.allocation,
        )
        _check(
            0 < self.initial_samples < group_size,
            f"{prefix}.initial_samples",
            f"1..group_size-1={group_size - 1} (allocation=vigor)",
            self.initial_samples,
        )
        _check(
            self.max_group_samples == 0 or self.max_group_samples >= group_size,
            f"{prefix}.max_group_samples",
            f"0 (2 * group_size) or at least group_size={group_size}",
            self.max_group_samples,
        )
        _check(
            self.admission == "exact",
            f"{prefix}.admission",
            "'exact' with allocation=vigor (its samples are drawn and scored within the step)",
            self.admission,
        )
        _check(
            not self.dynamic_sampling,
            f"{prefix}.dynamic_sampling",
            "false with allocation=vigor (vigor gives uninformative prompts fewer samples instead of dropping them)",
            self.dynamic_sampling,
        )


@dataclasses.dataclass(frozen=True)
class RolloutMeshConfig:
    """A layout of the rollout's own on the training mesh's devices (docs/scale.md): preset "" decodes
    under training's layout (mesh.*); "data" with the params replicated, each device decoding its rows;
    "fsdp"; "fsdp_tensor" with a `tensor` axis of `tensor` devices (Megatron tensor-parallel decode).
    The policy is resharded into it once per policy version; mesh.allow_replicated applies to it too."""

    preset: str = ""
    tensor: int = 1  # the rollout's tensor axis (preset="fsdp_tensor" only)

    def validate(self, prefix: str = "rollout.mesh") -> None:
        presets = ("", "data", "fsdp", "fsdp_tensor")
        _check(
            self.preset in presets,
            f"{prefix}.preset",
            "'' (training's layout), 'data', 'fsdp' or 'fsdp_tensor'",
            self.preset,
        )
        _check(self.tensor > 0, f"{prefix}.tensor", "a positive integer", self.tensor)
        _check(
            self.tensor == 1 or self.preset == "fsdp_tensor",
            f"{prefix}.tensor",
            f"1 unless {prefix}.preset='fsdp_tensor' (it is {self.preset!r})",
            self.tensor,
        )


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    group_size: int = 8
    prompts_per_step: int = 16
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    speculative: SpeculativeConfig = SpeculativeConfig()
    engine: EngineConfig = EngineConfig()
    mesh: RolloutMeshConfig = RolloutMeshConfig()  # "": decode under training's layout

    def validate(self, prefix: str = "rollout") -> None:
        _check(self.group_size > 0, f"{prefix}.group_size", "a positive integer", self.group_size)
        _check(self.prompts_per_step > 0, f"{prefix}.prompts_per_step", "a positive integer", self.prompts_per_step)
        _check(self.max_new_tokens > 0, f"{prefix}.max_new_tokens", "a positive integer", self.max_new_tokens)
        _check(self.temperature > 0, f"{prefix}.temperature", "a positive number", self.temperature)
        _check(self.top_k >= 0, f"{prefix}.top_k", "0 (off) or a positive integer", self.top_k)
        _check(0 < self.top_p <= 1, f"{prefix}.top_p", "a number in (0, 1]", self.top_p)
        self.speculative.validate(f"{prefix}.speculative")
        self.engine.validate(f"{prefix}.engine")
        self.mesh.validate(f"{prefix}.mesh")
        self.engine.check_allocation(self.group_size, f"{prefix}.engine")
        _check(
            not (self.engine.enabled and self.speculative.enabled) or self.speculative.drafter == "early_exit",
            f"{prefix}.speculative.drafter",
            f"'early_exit' with {prefix}.engine.enabled=true (the engine's only drafter)",
            self.speculative.drafter,
        )
        _check(
            not self.engine.enabled or self.engine.slots >= self.group_size,
            f"{prefix}.engine.slots",
            f"at least group_size={self.group_size} (a group is admitted into free slots at once)",
            self.engine.slots,
        )
