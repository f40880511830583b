"""A Hugging Face checkpoint's tokenizer behind the `Tokenizer` protocol of jaxrl.data.tokenizer.

    tok = load_tokenizer(checkpoint_dir)     # tokenizer.json via the `tokenizers` library; no network
    ids = tok.encode("2+2=")                  # no special tokens
    text = tok.apply_chat_template([{"role": "user", "content": "2+2?"}])   # if the checkpoint has one

Special ids come from the checkpoint's files, first found wins: generation_config.json, config.json,
tokenizer_config.json's token strings. `eos_ids` keeps every EOS id, `eos_id` (the first) is the one the
sampler stops on; `add_bos` says whether the tokenizer prepends BOS itself; without a pad token,
pad = the first EOS. The chat template (chat_template.jinja, else tokenizer_config.json's) renders in a
sandboxed jinja2 environment. `save_char_tokenizer` writes the character tokenizer as such files, for
`jaxrl convert --to-hf`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
from collections.abc import Sequence
from typing import Any

from jaxrl.config import ConfigError
from jaxrl.data.tokenizer import CharTokenizer

# The one install hint for the `hf` extra (`tokenizers`, `jinja2`): errors and docs/huggingface.md say this.
HF_EXTRA = "pip install -e '.[hf]'"


def _read_json(path: pathlib.Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e


def _token_text(value) -> str | None:
    """tokenizer_config.json stores a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


@dataclasses.dataclass(frozen=True)
class HFTokenizer:
    tokenizer: Any = dataclasses.field(repr=False)  # tokenizers.Tokenizer
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int
    eos_ids: tuple
    add_bos: bool
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = dataclasses.field(default=None, repr=False)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOS."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, stopping at the first EOS (any of eos_ids) and dropping PAD/BOS."""
        kept = []
        for i in ids:
            i = int(i)
            if i in self.eos_ids:
                break
            if i in (self.pad_id, self.bos_id):
                continue
            kept.append(i)
        return self.tokenizer.decode(kept, skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **variables) -> str:
        """The prompt text of `messages` ([{"role", "content"}]) under the checkpoint's chat template."""
        if not self.chat_template:
            raise ConfigError("this checkpoint's tokenizer_config.json has no chat_template")
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **variables,
        )


def render_chat_template(template: str, messages: list[dict], **variables) -> str:
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ConfigError(f"the `jinja2` package is needed for chat templates: {HF_EXTRA}") from e

    def raise_exception(message):
        raise ConfigError(f"chat template: {message}")

    def tojson(value, indent=None, ensure_ascii=False):  # as templates expect: no HTML escaping
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(messages=messages, **variables)
    except jinja2.TemplateError as e:
        raise ConfigError(f"chat template: {type(e).__name__}: {e}") from e


def load_tokenizer(directory) -> HFTokenizer:
    """The tokenizer of a local checkpoint directory (tokenizer.json + its config files)."""
    directory = pathlib.Path(directory)
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"{path}: not found (the checkpoint needs a fast-tokenizer tokenizer.json)")
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ConfigError(f"the `tokenizers` package is needed for Hugging Face tokenizers: {HF_EXTRA}") from e
    tok = Tokenizer.from_file(str(path))
    tok_cfg = _read_json(directory / "tokenizer_config.json")
    gen_cfg = _read_json(directory / "generation_config.json")
    model_cfg = _read_json(directory / "config.json")

    def token_id(field: str, text_key: str) -> list[int]:
        for source in (gen_cfg, model_cfg):
            value = source.get(field)
            if value is not None and value != []:
                return [int(v) for v in (value if isinstance(value, list) else [value])]
        text = _token_text(tok_cfg.get(text_key))
        if text is not None:
            i = tok.token_to_id(text)
            if i is None:
                raise ConfigError(
                    f"{directory / 'tokenizer_config.json'}: {text_key} {text!r} is not in tokenizer.json"
                )
            return [i]
        return []

    eos_ids = token_id("eos_token_id", "eos_token")
    if not eos_ids:
        raise ConfigError(
            f"{directory}: no EOS token (eos_token_id in generation_config.json / config.json, or "
            "eos_token in tokenizer_config.json)"
        )
    bos = token_id("bos_token_id", "bos_token")
    pad = token_id("pad_token_id", "pad_token")
    bos_id = bos[0] if bos else eos_ids[0]
    # Whether the tokenizer's own post-processor prepends BOS (tokenizer_config's add_bos_token wins).
    with_special = tok.encode("", add_special_tokens=True).ids  # "": any vocabulary encodes it
    add_bos = bool(bos) and tok_cfg.get("add_bos_token", bool(with_special) and with_special[0] == bos_id)
    jinja = directory / "chat_template.jinja"  # transformers 5's file; it wins over tokenizer_config's
    template = jinja.read_text() if jinja.is_file() else tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    vocab = int(model_cfg.get("vocab_size") or tok.get_vocab_size(with_added_tokens=True))

    def id_text(i):
        return tok.id_to_token(i) if i is not None else None

    return HFTokenizer(
        tok,
        vocab,
        pad[0] if pad else eos_ids[0],
        bos_id,
        eos_ids[0],
        tuple(eos_ids),
        bool(add_bos),
        _token_text(tok_cfg.get("bos_token")) or (id_text(bos[0]) if bos else None),
        _token_text(tok_cfg.get("eos_token")) or id_text(eos_ids[0]),
        template,
    )


# The special tokens' text in the exported files; their ids are the character tokenizer's (0, 1, 2).
CHAR_SPECIALS = {"pad": "<pad>", "bos": "<s>", "eos": "</s>"}


def save_char_tokenizer(tok: CharTokenizer, directory, max_length: int) -> list[str]:
    """`tok` as Hugging Face tokenizer files in `directory` that `AutoTokenizer.from_pretrained` (and
    `load_tokenizer`) read back to the same ids: a WordLevel vocabulary of single characters, BOS
    prepended as `encode_prompts` does, decoding without separators. -> the files written."""
    try:
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    except ImportError as e:
        raise ConfigError(f"exporting the character tokenizer needs the `tokenizers` package: {HF_EXTRA}") from e
    ids = {CHAR_SPECIALS["pad"]: tok.pad_id, CHAR_SPECIALS["bos"]: tok.bos_id, CHAR_SPECIALS["eos"]: tok.eos_id}
    vocab = {**ids, **{ch: tok.encode(ch)[0] for ch in tok.alphabet}}
    hf = Tokenizer(models.WordLevel(vocab, unk_token=None))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")  # every character a token
    hf.decoder = decoders.Fuse()
    bos = CHAR_SPECIALS["bos"]
    hf.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tok.bos_id)]
    )
    hf.add_special_tokens(list(ids))
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf.save(str(directory / "tokenizer.json"))
    specials = {f"{k}_token": v for k, v in CHAR_SPECIALS.items()}
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,  # " ," and " =" are text here, not spacing to tidy
        **specials,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    (directory / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
    return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
