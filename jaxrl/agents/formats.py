"""Which tool-call format a run's episodes speak, chosen by its tokenizer.

    fmt, end_of_turn = episode_format(cfg, tokenizer, suite)   # fmt None: the suite's own char syntax
    check_prompt_fits(cfg, tokenizer, suite, fmt)              # before any rollout

The embedded char models (CharTokenizer) speak the suite's default format (fmt None: for the
calculator the tag format `[calc 123*456]`) and end a turn with `suite.end_of_turn`. A Hugging Face
checkpoint (model.hf_path: HFTokenizer) speaks the Hermes/Qwen format: `<tool_call>{json}</tool_call>`
calls, `</tool_call>` ends a turn (it must be one token of the checkpoint's tokenizer, as Qwen2.5's
added token is), observations and the prompt rendered by the checkpoint's chat template, and the
tokenizer's EOS (`<|im_end|>` for Qwen) ends the episode.
"""

from __future__ import annotations

import numpy as np

from jaxrl.agents.tools import HermesFormat
from jaxrl.config import ConfigError
from jaxrl.data.hf_tokenizer import HFTokenizer


def check_model_format(cfg, suite) -> None:
    """A checkpoint's run needs a suite that speaks the Hermes format (one-line error otherwise)."""
    if cfg.model.hf_path and HermesFormat.name not in suite.formats:
        raise ConfigError(
            f"data.task={cfg.data.task!r} with model.hf_path={cfg.model.hf_path!r}: this environment "
            f"has no tool-call format for a Hugging Face tokenizer (it runs on the embedded char "
            f"models only); unset model.hf_path or pick data.task=agent_calculator"
        )


def episode_format(cfg, tokenizer, suite):
    """(fmt, end_of_turn): fmt for suite.make (None: its default) and the string that ends a model turn."""
    if not isinstance(tokenizer, HFTokenizer):
        return None, suite.end_of_turn
    check_model_format(cfg, suite)
    where = f"model.hf_path={cfg.model.hf_path!r}"
    if not tokenizer.chat_template:
        raise ConfigError(
            f"{where}: the checkpoint's tokenizer_config.json has no chat_template; multi-turn "
            f"episodes render their prompt and tool responses with it"
        )
    end_of_turn = HermesFormat.end_of_turn
    ids = tokenizer.encode(end_of_turn)
    if len(ids) != 1:
        raise ConfigError(
            f"{where}: the tokenizer splits the end of turn {end_of_turn!r} into {len(ids)} tokens; "
            f"multi-turn episodes need it as one (a special/added token, as in Qwen2.5)"
        )
    return HermesFormat.for_tokenizer(tokenizer), end_of_turn


def check_prompt_fits(cfg, tokenizer, suite, fmt) -> None:
    """The first training record's prompt, rendered as the episodes will render it, fits in
    data.max_prompt_len (one-line error with the length needed); checked before any rollout."""
    record = suite.records("train", 1, cfg.data.seed)[0]
    text = suite.make(cfg.agent, fmt).reset(record, np.random.default_rng(0))
    bos = [tokenizer.bos_id] if getattr(tokenizer, "add_bos", True) else []  # as jaxrl.rollout.episodes.driver does
    n = len(bos) + len(tokenizer.encode(text))
    if n > cfg.data.max_prompt_len:
        raise ConfigError(
            f"data.max_prompt_len={cfg.data.max_prompt_len}: the rendered prompt of "
            f"{cfg.data.task} record {record['id']!r} is {n} tokens; set data.max_prompt_len >= {n}"
        )
