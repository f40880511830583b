"""The Hugging Face tokenizer behind jaxrl's Tokenizer protocol: ids, special tokens and the chat
template agree with transformers' own fast tokenizer on tiny tokenizers trained offline."""

import json

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from jaxrl.config import ConfigError  # noqa: E402
from jaxrl.data.hf_tokenizer import load_tokenizer  # noqa: E402
from jaxrl.data.tokenizer import encode_prompts  # noqa: E402

CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? #### 72",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
] * 20
# A Qwen-style ChatML template (system default, generation prompt).
CHATML = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def _train(specials):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return tok


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen_tok")
    _train(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]).save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHATML,
            }
        )
    )
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "pad_token_id": 0}))
    return d


@pytest.fixture(scope="module")
def llama_like(tmp_path_factory):
    from tokenizers import processors

    d = tmp_path_factory.mktemp("llama_tok")
    tok = _train(["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>",
                "chat_template": LLAMA,
            }
        )
    )
    (d / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [4, 1], "vocab_size": 400}))
    return d


def test_ids_and_special_tokens_from_the_checkpoint(qwen_like, llama_like):
    q = load_tokenizer(qwen_like)
    assert (q.eos_id, q.eos_ids, q.pad_id, q.add_bos) == (2, (2, 0), 0, False)
    assert q.vocab_size == q.tokenizer.get_vocab_size()
    tok = load_tokenizer(llama_like)
    assert (tok.bos_id, tok.eos_id, tok.eos_ids, tok.pad_id, tok.add_bos, tok.vocab_size) == (
        0,
        4,
        (4, 1),
        4,
        True,
        400,
    )


@pytest.mark.parametrize("which", ["qwen_like", "llama_like"])
def test_encode_decode_and_chat_template_match_transformers(which, request):
    d = request.getfixturevalue(which)
    ours = load_tokenizer(d)
    ref = transformers.AutoTokenizer.from_pretrained(d)
    text = "Natalia sold 48 clips in April; how many in May? #### 72"
    assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text)) == text
    # decode stops at EOS and drops PAD/BOS
    ids = [ours.bos_id] * ours.add_bos + ours.encode("clips") + [ours.eos_id] + ours.encode("May")
    assert ours.decode(ids) == "clips"
    messages = [
        {"role": "user", "content": "How many clips?"},
        {"role": "assistant", "content": "72"},
        {"role": "user", "content": "And in May?"},
    ]
    for gen in (True, False):
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen
        )


def test_prompts_get_bos_only_when_the_tokenizer_adds_it(qwen_like, llama_like):
    for d, first in ((qwen_like, None), (llama_like, 0)):
        tok = load_tokenizer(d)
        ids = tok.encode("How many clips?")
        tokens, mask, _, _ = encode_prompts(tok, ["How many clips?"], 64, skip_long=False, record_ids=["r"])
        assert tokens[0].tolist() == ([first] if first is not None else []) + ids


def test_missing_files_and_template_errors_are_named(tmp_path, qwen_like):
    with pytest.raises(ConfigError, match="tokenizer.json: not found"):
        load_tokenizer(tmp_path)
    tok = load_tokenizer(qwen_like)
    bad = tok.__class__(**{**tok.__dict__, "chat_template": "{{ raise_exception('no system role') }}"})
    with pytest.raises(ConfigError, match="chat template: no system role"):
        bad.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_jinja_file_is_read_as_transformers_5_reads_it(tmp_path, qwen_like):
    """transformers 5 saves the template as chat_template.jinja, not in tokenizer_config.json."""
    import shutil

    d = tmp_path / "v5"
    shutil.copytree(qwen_like, d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "chat_template.jinja").write_text(LLAMA)
    ref = transformers.AutoTokenizer.from_pretrained(d)
    messages = [{"role": "user", "content": "How many clips?"}]
    ours = load_tokenizer(d).apply_chat_template(messages)
    assert ours == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|start_header_id|>" in ours


def test_character_tokenizer_exports_to_the_same_ids(tmp_path):
    """AutoTokenizer (and load_tokenizer) read save_char_tokenizer's files back to CharTokenizer's ids,
    BOS first as encode_prompts puts it, and decode them back to the text."""
    from jaxrl.data.hf_tokenizer import save_char_tokenizer
    from jaxrl.data.tokenizer import CharTokenizer

    char = CharTokenizer()
    save_char_tokenizer(char, tmp_path, 64)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "3,7,25:46= 25+3*7 (1-2)/4"
    assert ref(text)["input_ids"] == [char.bos_id, *char.encode(text)]
    assert ref.decode([char.bos_id, *char.encode(text), char.eos_id], skip_special_tokens=True) == text
    assert (ref.pad_token_id, ref.bos_token_id, ref.eos_token_id) == (char.pad_id, char.bos_id, char.eos_id)
    ours = load_tokenizer(tmp_path)
    assert ours.encode(text) == char.encode(text) and ours.add_bos
    assert (ours.pad_id, ours.bos_id, ours.eos_id) == (char.pad_id, char.bos_id, char.eos_id)


def test_without_tokenizers_the_export_names_the_extra(tmp_path, monkeypatch):
    import sys

    from jaxrl.data.hf_tokenizer import HF_EXTRA, save_char_tokenizer
    from jaxrl.data.tokenizer import CharTokenizer

    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` raises ImportError
    with pytest.raises(ConfigError, match="needs the `tokenizers` package") as e:
        save_char_tokenizer(CharTokenizer(), tmp_path, 64)
    assert str(e.value).endswith(HF_EXTRA) and not list(tmp_path.iterdir())
