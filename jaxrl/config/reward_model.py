"""Config section `reward_model.*`: a scalar reward model trained from preference pairs
(`jaxrl reward-model train`), and a trained one used as a reward function of an RL run.

Training reads pairs {"prompt", "chosen", "rejected"} from `pairs_file` (JSONL), or makes them with a
synthetic generator (`synthetic`); the model's shape is the run's `model.*` and its tokenizer the
run's (the task's alphabet, or model.hf_path's tokenizer). An RL run with `workdir` set scores every
completion with the reward model saved there: its score is one more column of rewards_BxK, after the
task's verifier's (so loss.reward_weights then has three weights: correctness, format, reward model).
"""

from __future__ import annotations

import dataclasses

from jaxrl.config.checks import _check, _check_learning_rate

SYNTHETIC = ("arithmetic", "even_last")
INIT = ("scratch", "base")


@dataclasses.dataclass(frozen=True)
class RewardModelConfig:
    # --- training (`jaxrl reward-model train CONFIG --workdir W`)
    pairs_file: str = ""  # JSONL of {"prompt", "chosen", "rejected"}; "" -> `synthetic` pairs
    test_file: str = ""  # held-out pairs (JSONL); "" -> the last num_test pairs of pairs_file
    synthetic: str = "arithmetic"  # arithmetic: the right sum over a wrong one; even_last: ends in an even digit
    num_train: int = 2000  # synthetic pairs to train on (at most this many from pairs_file)
    num_test: int = 200  # held-out pairs
    init: str = "scratch"  # scratch: a fresh backbone; base: the run's base policy (warm start / model.hf_path)
    steps: int = 300
    batch_size: int = 32
    learning_rate: float = 1e-3
    warmup_steps: int = 10
    eval_every: int = 50  # held-out pair accuracy every this many steps (and at the end)
    checkpoint_every: int = 100  # 0: only at the end
    seed: int = 0
    progress: bool = True  # a progress bar on stderr
    # --- use in an RL run
    workdir: str = ""  # a trained reward model's workdir: its score is reward column 2 ("" -> not used)
    score_batch: int = 0  # rows per jitted scoring forward (0: the step's rows at once)

    def validate(self, prefix: str = "reward_model") -> None:
        _check(self.synthetic in SYNTHETIC, f"{prefix}.synthetic", f"one of {SYNTHETIC}", self.synthetic)
        _check(self.init in INIT, f"{prefix}.init", f"one of {INIT}", self.init)
        _check(self.num_train > 0, f"{prefix}.num_train", "a positive integer", self.num_train)
        _check(self.num_test > 0, f"{prefix}.num_test", "a positive integer", self.num_test)
        _check(self.steps > 0, f"{prefix}.steps", "a positive integer", self.steps)
        _check(self.batch_size > 0, f"{prefix}.batch_size", "a positive integer", self.batch_size)
        _check_learning_rate(self.learning_rate, f"{prefix}.learning_rate")
        _check(self.warmup_steps >= 0, f"{prefix}.warmup_steps", "a non-negative integer", self.warmup_steps)
        _check(self.eval_every > 0, f"{prefix}.eval_every", "a positive integer", self.eval_every)
        _check(
            self.checkpoint_every >= 0,
            f"{prefix}.checkpoint_every",
            "a non-negative integer (0 = only at the end)",
            self.checkpoint_every,
        )
        _check(self.score_batch >= 0, f"{prefix}.score_batch", "a non-negative integer", self.score_batch)
        _check(
            not self.test_file or bool(self.pairs_file),
            f"{prefix}.test_file",
            "'' unless reward_model.pairs_file is set too",
            self.test_file,
        )
