"""Tools: the registry and both call formats; whatever the model writes gives an observation and counts,
never an exception."""

import json
import time

import pytest
from hf_stand_in import QWEN25  # Qwen2.5's chat template (tools included), shared with test_agent_hf.py

from jaxrl.agents.calculator import calculate
from jaxrl.agents.env import AGENT_ALPHABET
from jaxrl.agents.tools import (
    QWEN_TOOL_HEAD,
    QWEN_TOOL_SEP,
    QWEN_TOOL_TAIL,
    HermesFormat,
    TagFormat,
    Tool,
    ToolRegistry,
    ToolUse,
)
from jaxrl.config import ConfigError
from jaxrl.data.hf_tokenizer import render_chat_template


def _boom(_=None):
    raise ValueError("Boom Ünïcode ✓")


def _tools(fmt, max_output=2000):
    registry = ToolRegistry(
        [
            Tool("calc", calculate, "integer arithmetic"),
            Tool("boom", _boom, "always raises"),
            Tool("slow", lambda _=None: time.sleep(5), "outlives its limit", timeout_s=0.2),
            Tool("long", lambda _=None: "x" * 100, "a long result"),
        ],
        max_output=max_output,
    )
    return ToolUse(registry, fmt)


def test_tag_call_gives_the_result_compactly():
    turn = _tools(TagFormat()).respond("[calc 123*456]")
    # 123*456 = 123*400 + 123*56 = 49200 + 6888 = 56088
    assert turn.observation == ">56088\n"
    assert turn.info == {"tool_calls": 1, "tool_errors": 0, "tool_truncated": 0}
    assert _tools(TagFormat()).respond("think [calc 2*3]").observation == ">6\n"  # text before the call is fine


def test_a_turn_without_a_call_is_no_tool_turn():
    assert _tools(TagFormat()).respond("56088") is None
    assert _tools(HermesFormat()).respond("The answer is 56088.") is None


@pytest.mark.parametrize(
    "turn", ["[calc 1+2", "calc 1+2]", "[1+2]", "[calc [1]]", "[calc 1] [calc 2]", "[]", "[calc  1]x"]
)
def test_tag_malformed_call_is_an_error_observation(turn):
    out = _tools(TagFormat()).respond(turn)
    assert out.observation.startswith(">error: ") and out.observation.endswith("\n")
    assert out.info == {"tool_calls": 1, "tool_errors": 1, "tool_truncated": 0}


@pytest.mark.parametrize(
    "turn, message",
    [
        ("[nope 1]", ">error: unknown tool nope\n"),
        ("[boom 1]", ">error: valueerror: boom _n_code _\n"),
        ("[slow]", ">error: timeout after 0.2s\n"),
    ],
)
def test_tag_failing_tools_are_error_observations_in_the_alphabet(turn, message):
    start = time.monotonic()
    out = _tools(TagFormat()).respond(turn)
    assert time.monotonic() - start < 2  # the slow tool is not waited for
    # "Boom Ünïcode ✓": lower-cased, then what is outside AGENT_ALPHABET (ü, ï, ✓) becomes "_"
    assert out.observation == message
    assert set(out.observation) <= set(AGENT_ALPHABET)
    assert out.info == {"tool_calls": 1, "tool_errors": 1, "tool_truncated": 0}


def test_long_results_are_cut_and_counted():
    out = _tools(TagFormat(), max_output=10).respond("[long]")
    assert out.observation == ">" + "x" * 10 + "...\n"
    assert out.info == {"tool_calls": 1, "tool_errors": 0, "tool_truncated": 1}
    assert _tools(TagFormat(), max_output=100).respond("[long]").info["tool_truncated"] == 0  # exactly 100 fits


def _hermes_call(name, arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_hermes_call_gives_a_qwen_tool_response():
    out = _tools(HermesFormat()).respond("Let me compute.\n" + _hermes_call("calc", {"expression": "123*456"}))
    assert out.observation == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert out.info == {"tool_calls": 1, "tool_errors": 0, "tool_truncated": 0}
    two = _tools(HermesFormat()).respond(
        _hermes_call("calc", {"expression": "2*3"}) + "\n" + _hermes_call("calc", {"expression": "4*5"})
    )
    assert two.observation == QWEN_TOOL_HEAD + "6" + QWEN_TOOL_SEP + "20" + QWEN_TOOL_TAIL
    assert two.info["tool_calls"] == 2


@pytest.mark.parametrize(
    "turn",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "calc", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "calc", "arguments": "x"}</tool_call>',
        '<tool_call>{"name": "calc"',
        "oops</tool_call>",
        _hermes_call("calc", {"wrong": "1"}),
        _hermes_call("nope", {}),
        _hermes_call("boom", {}),
        _hermes_call("slow", {}),
    ],
)
def test_hermes_bad_calls_are_error_observations(turn):
    out = _tools(HermesFormat()).respond(turn)
    assert out.observation.startswith(QWEN_TOOL_HEAD + "error: ") and out.observation.endswith(QWEN_TOOL_TAIL)
    assert out.info == {"tool_calls": 1, "tool_errors": 1, "tool_truncated": 0}


def test_hermes_string_arguments_are_accepted():
    turn = '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"2*3\\"}"}</tool_call>'
    assert _tools(HermesFormat()).respond(turn).observation == QWEN_TOOL_HEAD + "6" + QWEN_TOOL_TAIL


def test_hermes_observation_matches_the_chat_template_transcript():
    fmt = HermesFormat(QWEN25)
    assert (fmt.head, fmt.sep, fmt.tail) == (QWEN_TOOL_HEAD, QWEN_TOOL_SEP, QWEN_TOOL_TAIL)
    # An episode's text (prompt + turn + observation) equals the template's rendering of the conversation
    # with the model's tool call as a structured tool_calls entry.
    user = [{"role": "user", "content": "What is 123*456?"}]
    prompt = render_chat_template(QWEN25, user, add_generation_prompt=True)
    turn = '<tool_call>\n{"name": "calc", "arguments": {"expression": "123*456"}}\n</tool_call>'
    observation = _tools(fmt).respond(turn).observation
    structured = user + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "calc", "arguments": {"expression": "123*456"}}}],
        },
        {"role": "tool", "content": "56088"},
    ]
    # The template writes "\n" between "<|im_start|>assistant" and a call when content is empty; the prompt
    # already ends with that newline (the generation prompt), so the model's turn starts at "<tool_call>".
    assert prompt + turn + observation == render_chat_template(QWEN25, structured, add_generation_prompt=True)


def test_hermes_template_without_tool_messages_is_a_config_error():
    plain = (
        "{% for m in messages %}{% if m.role != 'tool' %}{{ m.role + ': ' + m.content + '\\n' }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ConfigError, match="tool"):
        HermesFormat(plain)


def test_hermes_observation_tokenizes_with_the_checkpoints_special_tokens(tmp_path):
    """With a Qwen-like tokenizer built here: the observation's <|im_end|> / <|im_start|> are the special ids."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from jaxrl.data.hf_tokenizer import load_tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        ["tool_response user assistant 56088 calc expression"] * 10,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": QWEN25})
    )
    hf = load_tokenizer(tmp_path)
    out = _tools(HermesFormat(hf.chat_template)).respond(_hermes_call("calc", {"expression": "123*456"}))
    ids = hf.encode(out.observation)
    assert ids[0] == hf.eos_id == tok.token_to_id("<|im_end|>")
    assert ids.count(tok.token_to_id("<|im_start|>")) == 2
    assert hf.encode(HermesFormat.end_of_turn) == [tok.token_to_id("</tool_call>")]  # one token, as EnvSuite needs


def test_registry_rejects_repeated_names():
    with pytest.raises(ConfigError, match="repeated"):
        ToolRegistry([Tool("a", str, ""), Tool("a", str, "")])
