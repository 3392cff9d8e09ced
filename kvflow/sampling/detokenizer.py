"""Incremental detokenization and stop-string matching for streaming output.

Decoding the whole output after every token is quadratic in its length, and decoding each
new token on its own is wrong: byte-level BPE splits one UTF-8 character across tokens
(a Chinese character or an emoji is often 2-3 tokens, each decoding to "\\ufffd" alone), and
SentencePiece decoders drop the leading space of whatever token starts the decoded string.
`IncrementalDetokenizer` uses vLLM's two-offset scheme: it decodes a short window that starts
a few tokens before the new ones (`prefix_offset`), subtracts the text of the already-emitted
part of that window (up to `read_offset`), and only advances when the result does not end in
an incomplete character. The window therefore always starts on a character boundary and
carries enough left context for the decoder to place spaces as a full decode would.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from kvflow.outputs import Logprob

# How many prompt tokens seed the decoding window, as in vLLM: enough left context for any
# decoder's leading-space or byte-merging rules, small enough to keep each decode cheap.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into stable text deltas.

    `add_tokens` returns only text that no later token can change; the concatenation of all
    deltas equals `tokenizer.decode(output_ids, skip_special_tokens=...)` whenever that decode
    does not itself end in an incomplete character. Tokenization-space cleanup is always off:
    it rewrites text across token boundaries (" ." -> "."), so it cannot be streamed.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Only the prompt tail is kept: it is the left context of the first output tokens.
        context = [int(t) for t in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]]
        if self._decode(context).endswith(_REPLACEMENT_CHAR):
            # The prompt ends mid-character (prompts given as raw token ids can). Its bytes
            # must not merge with the output's, or the output text would depend on the
            # prompt; start from a clean boundary so deltas add up to decode(output).
            context = []
        self._ids: list[int] = context
        self._num_context = len(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self._prefix_text = self._decode(context[self.prefix_offset : self.read_offset])
        self._output_text = ""

    @property
    def output_text(self) -> str:
        """All text emitted so far (held-back incomplete characters excluded)."""
        return self._output_text

    @property
    def output_token_ids(self) -> list[int]:
        """Every output token id passed to `add_tokens`, in order."""
        return self._ids[self._num_context :]

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append tokens and return the newly stable text ("" while a character is incomplete)."""
        if not new_token_ids:
            return ""
        self._ids.extend(int(t) for t in new_token_ids)
        window_text = self._decode(self._ids[self.prefix_offset :])
        if window_text.endswith(_REPLACEMENT_CHAR):
            # The last bytes may be the start of a multi-byte character: wait for more tokens.
            return ""
        if window_text.startswith(self._prefix_text):
            delta = window_text[len(self._prefix_text) :]
        else:
            # Defensive: a decoder whose output for a window is not an extension of the
            # window's prefix. Emit from where the two decodes diverge.
            common = _common_prefix_len(window_text, self._prefix_text)
            delta = window_text[common:]
        # The new tokens end on a character boundary: they become the next window's prefix,
        # unless they decode to nothing (skipped special tokens, a bare SentencePiece space);
        # then the old prefix stays too, so the next token still has left context to
        # place its leading space.
        new_prefix_text = self._decode(self._ids[self.read_offset :])
        if new_prefix_text:
            self.prefix_offset = self.read_offset
            self._prefix_text = new_prefix_text
        else:
            self._prefix_text = window_text
        self.read_offset = len(self._ids)
        self._output_text += delta
        return delta


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def find_stop_string(
    text: str, new_text_len: int, stop: list[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """Find a stop string that ends inside the last `new_text_len` chars of `text`.

    Only the tail a new delta can affect is searched (len(new) + len(stop) - 1 chars per stop
    string), so matching stays O(delta) per step while still catching stop strings split
    across several tokens. Returns (stop string, length to truncate `text` to) or None. When
    several stop strings match, the one starting earliest wins (ties: the shortest, which
    was completed first), because generation would have stopped there.
    """
    if new_text_len <= 0 or not stop:
        return None
    best: tuple[int, int, str] | None = None  # (start, len, stop string)
    new_start = len(text) - new_text_len
    for s in stop:
        if not s:
            continue
        start = text.find(s, max(new_start - len(s) + 1, 0))
        if start == -1:
            continue
        candidate = (start, len(s), s)
        if best is None or candidate < best:
            best = candidate
    if best is None:
        return None
    start, length, s = best
    return s, start + length if include_stop_str_in_output else start


def stop_string_holdback(text: str, stop: list[str]) -> int:
    """Number of trailing chars of `text` that are a proper prefix of some stop string.

    A streaming server must not send these yet: the next token may complete a stop string,
    and the client should never see part of one.
    """
    longest = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


class CompletionText:
    """One completion's text, grown token by token, and the stop strings that may end it.

    The one piece of text handling both sides of the engine share: `LLMEngine` runs it beside
    the sampler (`LLM`, the in-process server), the split server's API process runs it on the
    token ids the engine core sends (`entrypoints/core/assembler.py`), so the two give the same
    text, cut at the same place, by construction. Without a tokenizer the text stays empty and
    no stop string can match (as the engine has always done for token-id-only models).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool,
                 stop: list[str], include_stop_str_in_output: bool) -> None:
        self._detokenizer = (IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
                             if tokenizer is not None else None)
        self._stop, self._include_stop = stop, include_stop_str_in_output
        self.text = ""
        self._prev_len = 0  # len(text) before the last token

    def add_token(self, token_id: int, stops: bool = False) -> None:
        """Detokenize one more output token (its text may be held back until a character completes).
        `stops`: the token ends the sequence (EOS, a stop token, the grammar's end); as in vLLM it
        adds no text unless include_stop_str_in_output."""
        self._prev_len = len(self.text)
        if stops and not self._include_stop:
            return
        if self._detokenizer is not None:
            self.text += self._detokenizer.add_tokens([token_id])

    def find_stop(self) -> str | None:
        """The stop string the last token completed, if any; the text is then cut where it ends
        generation (before the stop string, or after it with `include_stop_str_in_output`)."""
        if not self._stop or self._detokenizer is None:
            return None
        hit = find_stop_string(self.text, len(self.text) - self._prev_len, self._stop, self._include_stop)
        if hit is None:
            return None
        stop, cut = hit
        self.text = self.text[:cut]
        return stop


def decode_token(tokenizer: Any, token_id: int) -> str:
    """One token's own text, as logprobs name it: special tokens kept, no space clean-up (part
    of a character decodes to U+FFFD; `loader.tokenizer.token_bytes` gives its bytes)."""
    return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def name_tokens(entries: Iterable[dict[int, Logprob] | None], decode: Callable[[int], str]) -> None:
    """Fill in each logprob's `decoded_token`: the sampler, which sees logits only, leaves it
    to whoever holds the tokenizer (the engine, or a split server's API process)."""
    for entry in entries:
        if entry is not None:
            for token_id, logprob in entry.items():
                logprob.decoded_token = decode(token_id)
