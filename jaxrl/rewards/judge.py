"""A generative judge: a language model asked about each (prompt, completion), its answer read by a
verdict parser into a reward. Decoded on the slot engine (jaxrl.rollout.engine), the rollout's own
machinery: all of a step's judge prompts go to one `Engine.sample` call, which admits them into free
slots as they open and decodes them together (the LLM-as-a-judge of Zheng et al. 2023, arXiv:2306.05685,
batched on the training engine instead of an HTTP side-car).

    judge = Judge(template="Q:{prompt} A:{completion} ok?", verdict=r"(YES|NO)", scores={"YES": 1, "NO": 0})
    scorer = JudgeScorer.build(judge, model_cfg, params, tokenizer, rng=key)
    out = scorer(prompts, completions)          # JudgeOutput: reward_B, parsed_B, texts
    judge_metrics(out)                          # {"judge/unparsed_frac": ..., "judge/reward_mean": ...}

`parse_verdict(judge, text)`: the verdict regex's first match, group 1 (the whole match without a group),
then `scores[verdict]` when `scores` is given, else float(verdict). Text with no match, a verdict not in
`scores`, or one float() cannot read (or not finite) is unparsed: it scores 0 and is counted.
`JudgeVerifier` is the judge as a task's verifier (BatchVerifier): column 0 the judge's reward, column 1
whether its verdict parsed; a run logs the unparsed ones as reward/failed (reward/format = 1 - their share).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxrl.config import ConfigError, EngineConfig, ModelConfig, RewardModelConfig
from jaxrl.config.reward_model import judge_scores
from jaxrl.data.hf_tokenizer import load_tokenizer
from jaxrl.policy.pretrained import load_model
from jaxrl.rollout.engine.driver import Engine
from jaxrl.rollout.sampler import SamplingParams


@dataclasses.dataclass(frozen=True)
class Judge:
    """template: the judge's prompt, with "{prompt}" and "{completion}" in it. verdict: a regex (its
    first group, else the whole match, is the verdict). scores: verdict -> reward (None: float(verdict)).
    max_new_tokens: the judge's answer length; prompt_len: its prompt's (a longer one keeps its end);
    greedy: argmax decoding (else sampled at `temperature`)."""

    template: str
    verdict: str
    scores: Mapping[str, float] | None = None
    max_new_tokens: int = 8
    prompt_len: int = 64
    greedy: bool = True
    temperature: float = 1.0

    def __post_init__(self):
        for key in ("{prompt}", "{completion}"):
            if key not in self.template:
                raise ConfigError(f"Judge.template: {self.template!r} has no {key}")
        try:
            re.compile(self.verdict)
        except re.error as e:
            raise ConfigError(f"Judge.verdict: {self.verdict!r} is not a regular expression ({e})") from None
        if self.max_new_tokens <= 0 or self.prompt_len <= 0:
            raise ConfigError(
                f"Judge.max_new_tokens / prompt_len: got {self.max_new_tokens} / {self.prompt_len}, expected positive"
            )

    def fill(self, prompt: str, completion: str) -> str:
        return self.template.replace("{prompt}", prompt).replace("{completion}", completion)


def parse_verdict(judge: Judge, text: str) -> float | None:
    """The reward the judge's `text` gives, or None when its verdict does not parse."""
    match = re.search(judge.verdict, text)
    if match is None:
        return None
    verdict = match.group(1) if match.re.groups else match.group(0)
    if judge.scores is not None:
        value = judge.scores.get(verdict)
        return None if value is None else float(value)
    try:
        value = float(verdict)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


class JudgeOutput(NamedTuple):
    reward_B: np.ndarray  # float32; 0 where the verdict did not parse
    parsed_B: np.ndarray  # bool
    texts: list[str]  # the judge's answers


def judge_metrics(out: JudgeOutput) -> dict:
    """judge/unparsed_frac (answers with no readable verdict, scored 0) and judge/reward_mean."""
    n = max(len(out.texts), 1)
    return {
        "judge/unparsed_frac": float((~out.parsed_B).sum() / n),
        "judge/reward_mean": float(out.reward_B.sum() / n),
    }


@dataclasses.dataclass(frozen=True)
class JudgeScorer:
    """The judge model on its own slot engine: (prompts, completions) -> JudgeOutput."""

    judge: Judge
    engine: Engine
    params: Any
    tokenizer: Any

    @classmethod
    def build(cls, judge: Judge, model_cfg: ModelConfig, params, tokenizer, *, rng, slots: int = 32, chunk: int = 8):
        """An engine of `slots` slots (one sample per prompt) decoding `chunk` steps between admissions."""
        sampling = SamplingParams(
            temperature=judge.temperature,
            greedy=judge.greedy,
            max_new_tokens=judge.max_new_tokens,
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
        )
        engine_cfg = EngineConfig(enabled=True, slots=slots, chunk=chunk, admit_groups=min(4, slots))
        engine = Engine(model_cfg, engine_cfg, sampling=sampling, group_size=1, prompt_len=judge.prompt_len, rng=rng)
        return cls(judge, engine, params, tokenizer)

    def prompt_tokens(self, prompt: str, completion: str) -> np.ndarray:
        """BOS + the filled template (its last prompt_len tokens when longer)."""
        bos = [self.tokenizer.bos_id] if getattr(self.tokenizer, "add_bos", True) else []
        ids = bos + self.tokenizer.encode(self.judge.fill(prompt, completion))
        return np.asarray(ids[-self.judge.prompt_len :], np.int32)

    def __call__(self, prompts: Sequence[str], completions: Sequence[str]) -> JudgeOutput:
        requests = [(i, self.prompt_tokens(p, c), 1) for i, (p, c) in enumerate(zip(prompts, completions, strict=True))]
        groups = self.engine.sample(self.params, 0, requests) if requests else []
        texts = [self.tokenizer.decode(g.tokens_GxT[0]) for g in groups]
        verdicts = [parse_verdict(self.judge, t) for t in texts]
        parsed_B = np.array([v is not None for v in verdicts], bool)
        reward_B = np.array([0.0 if v is None else v for v in verdicts], np.float32)
        return JudgeOutput(reward_B, parsed_B, texts)


@dataclasses.dataclass(frozen=True)
class JudgeVerifier:
    """The judge as a task's verifier: columns (the judge's reward, whether its verdict parsed); its
    unparsed verdicts are the batch's failures (a run's reward/failed: scored 0 and counted)."""

    scorer: JudgeScorer

    def __call__(self, completion: str, finished: bool, record: Mapping[str, str]):
        out = self.scorer([record["prompt"]], [completion])
        return float(out.reward_B[0]), float(out.parsed_B[0])

    def score_batch(
        self, completions: list[str], finished: list[bool], records: Sequence[Mapping[str, str]]
    ) -> tuple[np.ndarray, int]:
        out = self.scorer([r["prompt"] for r in records], completions)
        return np.stack([out.reward_B, out.parsed_B.astype(np.float32)], axis=1), int((~out.parsed_B).sum())


def load_judge(rm: RewardModelConfig, seed: int) -> JudgeVerifier:
    """The judge of reward_model.judge_* as a verifier: the model in judge_path (a Hugging Face
    checkpoint or a `jaxrl convert` output, with its tokenizer) on an engine of judge_slots slots."""
    path = pathlib.Path(rm.judge_path).expanduser()
    if not path.is_dir():
        raise ConfigError(f"reward_model.judge_path: directory {str(path)!r} not found")
    tokenizer = load_tokenizer(path)
    model = ModelConfig(hf_path=str(path), max_seq_len=rm.judge_prompt_len + rm.judge_max_new_tokens)
    model_cfg, params = load_model(model)
    judge = Judge(
        template=rm.judge_template,
        verdict=rm.judge_verdict,
        scores=judge_scores(rm.judge_scores),
        max_new_tokens=rm.judge_max_new_tokens,
        prompt_len=rm.judge_prompt_len,
        greedy=rm.judge_greedy,
    )
    scorer = JudgeScorer.build(judge, model_cfg, params, tokenizer, rng=jax.random.key(seed), slots=rm.judge_slots)
    return JudgeVerifier(scorer)
