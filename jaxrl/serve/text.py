"""A choice's text as its tokens arrive: decoded incrementally, released in pieces safe to stream, and cut
before the first stop string. Pure host bookkeeping over a `Tokenizer` (jaxrl.data.tokenizer).

The whole completion is re-decoded after every token (without stop strings, after every batch of
tokens `add_many` takes: a chunk's), since a tokenizer's text of a token can depend on its neighbours
(byte-level merges, leading spaces), and text is released up to what can no longer change
or turn into a stop string: a trailing U+FFFD (an unfinished UTF-8 sequence) and a trailing partial
match of a stop string are held back until the next token settles them. A stop string found in the
text ends the choice: its text is cut before the stop string, while its tokens (`ids`, `logprobs`) keep
every token sampled, the ones spelling the stop string included: they are what the model drew.
"""

from __future__ import annotations

import dataclasses

from jaxrl.data.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of `text` may still change or begin a stop string."""
    keep = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), keep, -1):
            if text.endswith(stop[:k]):
                keep = k
                break
    tail = len(text) - len(text.rstrip(REPLACEMENT))
    return max(keep, tail)


@dataclasses.dataclass
class ChoiceText:
    """One choice's tokens, log-probs and text; `add` each token, `finish` once."""

    tokenizer: Tokenizer
    stops: tuple[str, ...] = ()
    ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    text: str = ""  # the decoded text (cut before a stop string once one is hit)
    sent: int = 0  # characters of `text` already released
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token: int, logprob: float) -> str:
        """Append one sampled token -> the text now safe to release (maybe ""). Ends the choice with
        finish_reason "stop" when its text reaches a stop string."""
        assert not self.finished, "a finished choice takes no tokens"
        self.ids.append(int(token))
        self.logprobs.append(float(logprob))
        self.text = self.tokenizer.decode(self.ids)
        if self.stops:
            start = max(0, self.sent - max(len(s) for s in self.stops) + 1)
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                return self.finish("stop")
        ready = len(self.text) - held_back(self.text, self.stops)
        if ready <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent : ready], ready
        return piece

    def add_many(self, tokens: list[int], logprobs: list[float]) -> str:
        """`add` of several tokens in order -> the text released by them all. Without stop strings the
        completion is decoded once for them all (a chunk's tokens: one decode, not one per token); with
        stop strings token by token, so the choice still ends at the token that completes one."""
        if self.stops:
            pieces = []
            for token, logprob in zip(tokens, logprobs, strict=True):
                if self.finished:
                    break
                pieces.append(self.add(token, logprob))
            return "".join(pieces)
        assert not self.finished, "a finished choice takes no tokens"
        self.ids += [int(t) for t in tokens]
        self.logprobs += [float(lp) for lp in logprobs]
        self.text = self.tokenizer.decode(self.ids)
        ready = len(self.text) - held_back(self.text, ())
        if ready <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent : ready], ready
        return piece

    def finish(self, reason: str) -> str:
        """End the choice -> the text not yet released."""
        self.finish_reason = reason
        piece, self.sent = self.text[self.sent :], len(self.text)
        return piece

    def token_text(self, i: int) -> str:
        """The text of token i alone (EOS and special tokens: "")."""
        return self.tokenizer.decode([self.ids[i]])
