"""Multi-turn tool episodes on a Hugging Face checkpoint: the calculator speaks the Hermes/Qwen
`<tool_call>{json}</tool_call>` format, its prompt and tool responses rendered by the checkpoint's chat
template; `jaxrl train` runs agent_calculator on a tiny Qwen2 stand-in (built here, no hub); the
combinations that cannot work are one-line config errors."""

import json

import numpy as np
import pytest

pytestmark = pytest.mark.usefixtures("persistent_compile_cache")  # training runs repeat programs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from conftest import REPO  # noqa: E402
from hf_stand_in import CHATML_SPECIALS, QWEN25, TOOL_SPECIALS, save_bpe_tokenizer, save_tiny_qwen2  # noqa: E402

from jaxrl.agents.calculator import CALC_PARAMETERS, SUITE, records  # noqa: E402
from jaxrl.agents.tools import HermesFormat  # noqa: E402
from jaxrl.config import AgentConfig, ConfigError, load_config  # noqa: E402
from jaxrl.data.hf_tokenizer import load_tokenizer  # noqa: E402

CONFIG = REPO / "configs" / "agent_calculator.py"
EOT_ID, EOS_ID = 4, 2  # </tool_call> and <|im_end|>: specials come first in the BPE's ids
VOCAB = 512
PROMPT_LEN = 224  # the rendered prompt of the first record is 198 tokens of this BPE (checked in the test)


def _bias_stops(model, eot_logit: float, eos_logit: float) -> None:
    """Make a random model stop now and then: every token's embedding gets a constant 4.0 in feature 0,
    which dominates the (init std 0.02) residual stream, so after the final RMSNorm h[0] ~ sqrt(32) for
    every position; the lm_head's feature-0 weights are zeroed except for </tool_call> and EOS, so their
    logits are ~eot_logit and ~eos_logit and the rest ~0. With 512 tokens: p(</tool_call>) =
    e^3.5 / (e^3.5 + e^2 + 510) ~ 33 / 550 ~ 6% per token, p(EOS) = 7.4 / 550 ~ 1.3%: a turn usually
    ends at </tool_call> after ~14 tokens, and sometimes an episode ends with EOS."""
    scale = 1.0 / np.sqrt(32.0)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 4.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[EOT_ID, 0] = eot_logit * scale
        model.lm_head.weight[EOS_ID, 0] = eos_logit * scale


@pytest.fixture(scope="module")
def qwen_agent(tmp_path_factory):
    """A tiny Qwen2 with untied, biased lm_head and a BPE with ChatML + tool-call specials and Qwen2.5's template."""
    d = tmp_path_factory.mktemp("qwen_agent")
    fmt = HermesFormat(QWEN25)
    env = SUITE.make(AgentConfig(), fmt)

    def call(r):
        return f'<tool_call>{{"name": "calc", "arguments": {{"expression": "{r["expression"]}"}}}}</tool_call>'

    corpus = [env.reset(r, np.random.default_rng(0)) + env.step(call(r)).observation for r in records("train", 20, 0)]
    tok = save_bpe_tokenizer(
        d,
        corpus * 5,
        VOCAB - 12,
        CHATML_SPECIALS + TOOL_SPECIALS,
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": QWEN25},
    )
    assert (tok.token_to_id("<|im_end|>"), tok.token_to_id("</tool_call>")) == (EOS_ID, EOT_ID)
    model = save_tiny_qwen2(d, VOCAB, eos_token_id=EOS_ID, pad_token_id=0, tie=False)
    _bias_stops(model, 3.5, 2.0)
    model.save_pretrained(d)
    return d


@pytest.mark.slow
def test_hermes_calculator_episode_renders_the_chat_and_scores_the_answer(qwen_agent):
    tok = load_tokenizer(qwen_agent)
    fmt = HermesFormat.for_tokenizer(tok)
    env = SUITE.make(AgentConfig(), fmt)
    record = {"id": "123*456", "prompt": "123*456=", "expression": "123*456", "answer": "56088"}
    prompt = env.reset(record, np.random.default_rng(0))
    # The prompt is what the checkpoint's template gives for the user message with the calculator's schema
    # as `tools` (transformers' own renderer of tokenizer_config.json's template, not ours) ...
    schema = {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "integer arithmetic with + - * and parentheses",
            "parameters": CALC_PARAMETERS,
        },
    }
    hf_tok = transformers.AutoTokenizer.from_pretrained(qwen_agent)
    user = [{"role": "user", "content": "123*456="}]
    assert prompt == hf_tok.apply_chat_template(user, tools=[schema], tokenize=False, add_generation_prompt=True)
    # ... a system message listing the schema as one JSON line, then the user message and the generation prompt.
    assert "<tools>\n" + json.dumps(schema) + "\n</tools>" in prompt
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith(
        "<|im_start|>user\n123*456=<|im_end|>\n<|im_start|>assistant\n"
    )
    # A valid JSON call -> the tool message as the template renders it (123*456 = 49200 + 6888 = 56088).
    call = '<tool_call>\n{"name": "calc", "arguments": {"expression": "123*456"}}\n</tool_call>'
    step = env.step(call)
    assert step.observation == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert (step.reward, step.done, step.info["tool_calls"], step.info["tool_errors"]) == (0.0, False, 1, 0)
    conversation = user + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "calc", "arguments": {"expression": "123*456"}}}],
        },
        {"role": "tool", "content": "56088"},
    ]
    assert prompt + call + step.observation == hf_tok.apply_chat_template(
        conversation, tools=[schema], tokenize=False, add_generation_prompt=True
    )
    final = env.step("56088")  # the final turn (its EOS is not part of the action)
    assert (final.reward, final.done, final.info["success"]) == (1.0, True, True)
    wrong = SUITE.make(AgentConfig(), fmt)
    wrong.reset(record, np.random.default_rng(0))
    assert wrong.step("56089").reward == 0.0


def _agent_cfg(d, *extra):
    return load_config(
        CONFIG,
        [
            f"model.hf_path={d}",
            "model.dtype=float32",
            "model.max_seq_len=288",
            f"data.max_prompt_len={PROMPT_LEN}",
            "data.num_train=40",
            "data.num_test=4",
            "rollout.prompts_per_step=2",
            "rollout.group_size=2",
            "rollout.max_new_tokens=48",
            "rollout.engine.slots=4",
            "agent.max_obs_tokens=48",
            "train.steps=2",
            "train.eval_every=0",
            "train.eval_prompts=2",
            "train.microbatches=1",
            "train.progress=false",
            "checkpoint.every=0",
            "mesh.preset=single",
            "optim.warmup_steps=0",
            *extra,
        ],
    )


@pytest.mark.slow
def test_agent_calculator_trains_two_steps_on_a_qwen_checkpoint(qwen_agent, tmp_path, in_process_cache):
    from jaxrl.agents.formats import check_prompt_fits, episode_format
    from jaxrl.train.loop import train

    cfg = _agent_cfg(qwen_agent)
    tok = load_tokenizer(qwen_agent)
    fmt, end_of_turn = episode_format(cfg, tok, SUITE)
    assert isinstance(fmt, HermesFormat) and end_of_turn == "</tool_call>" and tok.eos_id == EOS_ID
    first = SUITE.make(cfg.agent, fmt).reset(records("train", 1, cfg.data.seed)[0], None)
    assert 80 <= len(tok.encode(first)) <= PROMPT_LEN  # Qwen adds no BOS; the BPE knows the system text
    check_prompt_fits(cfg, tok, SUITE, fmt)
    rows = train(cfg, tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert np.isfinite(r["loss"]) and r["rollout/samples"] == 4
    # The stand-in stops at </tool_call> now and then (its lm_head is biased toward it): those turns are
    # environment steps with a malformed call (no <tool_call> opened) that the calculator answers with a
    # chat-rendered error and the episode goes on; so episodes have more than one turn.
    steps = rows[1:]
    assert sum(r["agent/env_steps"] for r in steps) > 0
    assert max(r["agent/turns_mean"] for r in steps) > 1
    assert sum(r["agent/tool_errors"] for r in steps) > 0 and max(r["agent/tool_calls_mean"] for r in steps) > 0


@pytest.mark.slow
def test_gridworld_with_a_checkpoint_is_a_one_line_error(qwen_agent, tmp_path):
    from jaxrl.train.loop import train

    cfg = _agent_cfg(qwen_agent, "data.task=agent_gridworld")
    with pytest.raises(ConfigError) as err:
        train(cfg, tmp_path / "run")
    message = str(err.value)
    assert "data.task='agent_gridworld'" in message and f"model.hf_path='{qwen_agent}'" in message
    assert "\n" not in message


@pytest.mark.slow
def test_an_over_long_rendered_prompt_is_a_one_line_error(qwen_agent, tmp_path, in_process_cache):
    """`jaxrl train` stops before any rollout, naming the field and the length the first record needs."""
    from jaxrl.agents.formats import episode_format
    from jaxrl.train.loop import train

    cfg = _agent_cfg(qwen_agent, "data.max_prompt_len=40")
    tok = load_tokenizer(qwen_agent)
    fmt, _ = episode_format(cfg, tok, SUITE)
    n = len(tok.encode(SUITE.make(cfg.agent, fmt).reset(records("train", 1, cfg.data.seed)[0], None)))
    with pytest.raises(ConfigError) as err:
        train(cfg, tmp_path / "run")
    message = str(err.value)
    assert message.startswith("data.max_prompt_len=40: ") and message.endswith(f"set data.max_prompt_len >= {n}")
    assert "\n" not in message


def test_end_of_turn_split_by_the_tokenizer_is_a_one_line_error(tmp_path):
    """A checkpoint whose tokenizer has no </tool_call> token cannot end Hermes turns."""
    from jaxrl.agents.formats import episode_format

    save_bpe_tokenizer(
        tmp_path,
        ["<tool_call> calc </tool_call>"] * 5,
        300,
        CHATML_SPECIALS,
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": QWEN25},
    )
    cfg = _agent_cfg(tmp_path)
    with pytest.raises(
        ConfigError,
        match=rf"^model.hf_path='{tmp_path}': the tokenizer splits the end of turn "
        r"'</tool_call>' into \d+ tokens; .*as in Qwen2.5\)$",
    ):
        episode_format(cfg, load_tokenizer(tmp_path), SUITE)


@pytest.mark.slow
def test_a_template_without_tool_support_or_no_template_is_a_config_error(qwen_agent, tmp_path):
    from jaxrl.agents.formats import episode_format
    from jaxrl.agents.tools import ToolRegistry

    # Renders messages and tool messages but drops `tools`: the model would never see the schema.
    no_tools = QWEN25.replace("{%- if tools %}", "{%- if false %}")
    with pytest.raises(ConfigError, match=r"does not render tools=\[...\] \(no schema of calc"):
        SUITE.make(AgentConfig(), HermesFormat(no_tools)).reset(records("train", 1, 0)[0], None)
    with pytest.raises(ConfigError, match="needs the checkpoint's chat template"):
        HermesFormat().prompt("1*2=", ToolRegistry([]))
    config = json.loads((qwen_agent / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text((qwen_agent / "tokenizer.json").read_text())
    with pytest.raises(ConfigError, match=rf"^model.hf_path='{tmp_path}': .* has no chat_template"):
        episode_format(_agent_cfg(tmp_path), load_tokenizer(tmp_path), SUITE)


def test_the_char_model_keeps_the_tag_format_and_the_bare_prompt():
    from jaxrl.agents.formats import episode_format
    from jaxrl.data.tokenizer import CharTokenizer

    cfg = load_config(CONFIG, [])
    fmt, end_of_turn = episode_format(cfg, CharTokenizer(SUITE.alphabet), SUITE)
    assert (fmt, end_of_turn) == (None, "]")
    env = SUITE.make(cfg.agent, fmt)
    assert env.reset(records("train", 1, 0)[0], None) == records("train", 1, 0)[0]["prompt"]
    assert env.step("[calc 2*3]").observation == ">6\n"
