"""Config section `reward_model.*`: a scalar reward model trained from preference pairs
(`jaxrl reward-model train`), and a trained one used as a reward function of an RL run.

Training reads pairs {"prompt", "chosen", "rejected"} from `pairs_file` (JSONL), or makes them with a
synthetic generator (`synthetic`); the model's shape is the run's `model.*` and its tokenizer the
run's (the task's alphabet, or model.hf_path's tokenizer). An RL run with `workdir` set scores every
completion with the reward model saved there: its score is one more column of rewards_BxK, after the
task's verifier's (so loss.reward_weights then has three weights: correctness, format, reward model).
With `judge_path` set, a generative judge (jaxrl.rewards.judge) replaces the task's verifier: reward
column 0 is its verdict's reward, column 1 whether the verdict parsed.
"""

from __future__ import annotations

import dataclasses
import re

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
    # --- a generative judge in an RL run (judge_path "" -> none)
    judge_path: str = ""  # the judge model: a Hugging Face checkpoint or a `jaxrl convert` output (with tokenizer)
    judge_template: str = "{prompt}{completion}"  # the judge's prompt: "{prompt}" and "{completion}" filled in
    judge_verdict: str = "([0-9]+)"  # regex; its first group (else the whole match) is the verdict
    judge_scores: str = ""  # "YES=1,NO=0": verdict -> reward; "" -> the verdict read as a number
    judge_max_new_tokens: int = 8
    judge_prompt_len: int = 64  # a longer judge prompt keeps its last tokens
    judge_slots: int = 32  # the judge engine's slots: judge prompts decoded at once
    judge_greedy: bool = True  # else sampled at temperature 1

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
        self._validate_judge(prefix)
        _check(
            not self.test_file or bool(self.pairs_file),
            f"{prefix}.test_file",
            "'' unless reward_model.pairs_file is set too",
            self.test_file,
        )

    def _validate_judge(self, prefix: str) -> None:
        for key in ("{prompt}", "{completion}"):
            _check(
                key in self.judge_template,
                f"{prefix}.judge_template",
                f"a string containing {key}",
                self.judge_template,
            )
        try:
            re.compile(self.judge_verdict)
        except re.error as e:
            _check(False, f"{prefix}.judge_verdict", f"a regular expression ({e})", self.judge_verdict)
        try:
            judge_scores(self.judge_scores)
        except ValueError:
            _check(False, f"{prefix}.judge_scores", "'' or 'VERDICT=number,...' (e.g. 'YES=1,NO=0')", self.judge_scores)
        for name in ("judge_max_new_tokens", "judge_prompt_len", "judge_slots"):
            _check(getattr(self, name) > 0, f"{prefix}.{name}", "a positive integer", getattr(self, name))


def judge_scores(text: str) -> dict[str, float] | None:
    """'YES=1,NO=0' -> {"YES": 1.0, "NO": 0.0}; '' -> None (the verdict is read as a number)."""
    if not text:
        return None
    pairs = [item.rpartition("=") for item in text.split(",")]
    if any(not key or not eq for key, eq, _ in pairs):
        raise ValueError(text)
    return {key: float(value) for key, _, value in pairs}
