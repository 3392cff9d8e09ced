"""Incremental detokenization (real SmolLM2 byte-level BPE + a toy SentencePiece-style
tokenizer) and stop-string search/holdback."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow.sampling.detokenizer import IncrementalDetokenizer, find_stop_string, stop_string_holdback

_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def tokenizer():
    import transformers

    from tests.conftest import smollm2_path  # fails loudly if the default model is missing

    path = smollm2_path()
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def interesting_ids(tokenizer) -> list[int]:
    """Token ids that exercise the hard cases: single bytes, CJK/emoji fragments, specials."""
    vocab = tokenizer.get_vocab()
    byte_tokens = [i for t, i in vocab.items() if len(t) == 1]
    text = "你好，世界！😀👍🏽 naïve café 日本語 ü ß 𝔘 \n\t  spaces"
    return sorted(set(byte_tokens) | set(tokenizer.encode(text)) | set(tokenizer.all_special_ids))


def _stream(
    tokenizer, prompt: list[int], output: list[int], chunks: list[int], skip: bool
) -> tuple[list[str], IncrementalDetokenizer]:
    det = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    deltas, pos, k = [], 0, 0
    while pos < len(output):
        size = chunks[k % len(chunks)] if chunks else 1
        deltas.append(det.add_tokens(output[pos : pos + size]))
        pos += size
        k += 1
    return deltas, det


def _check_stream(
    tokenizer, prompt: list[int], output: list[int], chunks: list[int], skip: bool, continuation: bool = False
) -> None:
    """Deltas must add up to decode(output); with `continuation`, to the text the output adds
    after the prompt (what SentencePiece-style tokenizers need: "▁world" after a prompt is
    " world", not "world")."""
    deltas, det = _stream(tokenizer, prompt, output, chunks, skip)
    full = tokenizer.decode(output, skip_special_tokens=skip)
    if continuation and prompt:
        before = tokenizer.decode(prompt, skip_special_tokens=skip)
        full = tokenizer.decode(prompt + output, skip_special_tokens=skip)
        assert full.startswith(before)
        full = full[len(before) :]
    text = "".join(deltas)
    assert text == det.output_text
    assert det.output_token_ids == output
    if full.endswith("\ufffd"):
        # The tail may still be an incomplete character: only a prefix can be stable.
        assert full.startswith(text)
    else:
        assert text == full


def test_chinese_and_emoji_streamed_token_by_token(tokenizer) -> None:
    text = "你好，世界！😀 Hello 👍🏽 world"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # multi-byte chars really are split across tokens
    det = IncrementalDetokenizer(tokenizer, tokenizer.encode("User: "))
    deltas = [det.add_tokens([t]) for t in ids]
    assert "".join(deltas) == text == det.output_text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some tokens were held back as incomplete characters


def test_leading_spaces_and_specials(tokenizer) -> None:
    ids = tokenizer.encode(" Hello   world<|im_end|>  again")
    for skip in (True, False):
        _check_stream(tokenizer, [], ids, [1], skip)
        _check_stream(tokenizer, tokenizer.encode("Prompt:"), ids, [2, 1, 3], skip)


def test_prompt_is_not_emitted(tokenizer) -> None:
    det = IncrementalDetokenizer(tokenizer, tokenizer.encode("The prompt text"))
    assert det.add_tokens(tokenizer.encode(" answer")) == " answer"
    assert det.add_tokens([]) == ""


@_SETTINGS
@given(data=st.data(), skip=st.booleans())
def test_property_deltas_concatenate_to_full_decode(tokenizer, interesting_ids, data, skip) -> None:
    vocab_size = len(tokenizer)
    token = st.one_of(st.integers(0, vocab_size - 1), st.sampled_from(interesting_ids))
    output = data.draw(st.lists(token, max_size=40), label="output")
    prompt = data.draw(st.lists(token, max_size=8), label="prompt")
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=5), label="chunks")
    _check_stream(tokenizer, prompt, output, chunks, skip)


@_SETTINGS
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=30))
def test_property_roundtrip_text(tokenizer, text) -> None:
    ids = tokenizer.encode(text)
    _check_stream(tokenizer, [], ids, [1], True)


def _metaspace_tokenizer():
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "▁hello": 2, "▁world": 3, "hello": 4, "▁": 5, "!": 6, "▁a": 7}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tk.decoder = tokenizers.decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", unk_token="<unk>")


@given(output=st.lists(st.integers(0, 7), max_size=12), skip=st.booleans())
@settings(max_examples=200, deadline=None)
def test_sentencepiece_style_leading_spaces(output, skip) -> None:
    """Decoding "▁world" alone drops its space; the prefix window must keep it."""
    tok = _metaspace_tokenizer()
    for prompt in ([], [2], [1]):
        _check_stream(tok, prompt, output, [1], skip, continuation=True)


def test_sentencepiece_space_after_skipped_special() -> None:
    tok = _metaspace_tokenizer()
    det = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    assert [det.add_tokens([t]) for t in (2, 1, 3)] == ["hello", "", " world"]


# ---------------------------------------------------------------- stop strings


def _stream_stop(pieces: list[str], stop: list[str], include: bool) -> tuple[str, str | None, int]:
    """Feed deltas like the engine does; return (final text, matched stop, step it fired)."""
    text = ""
    for step, piece in enumerate(pieces):
        text += piece
        hit = find_stop_string(text, len(piece), stop, include)
        if hit is not None:
            return text[: hit[1]], hit[0], step
    return text, None, -1


def test_stop_string_split_across_tokens(tokenizer) -> None:
    ids = tokenizer.encode("The answer is 42.###END### trailing")
    det = IncrementalDetokenizer(tokenizer, [])
    pieces = [det.add_tokens([t]) for t in ids]
    assert "###END###" not in pieces  # really split
    text, matched, _ = _stream_stop(pieces, ["###END###"], include=False)
    assert (matched, text) == ("###END###", "The answer is 42.")
    text, matched, _ = _stream_stop(pieces, ["###END###"], include=True)
    assert (matched, text) == ("###END###", "The answer is 42.###END###")


def test_stop_string_in_one_piece_with_extra_text() -> None:
    assert find_stop_string("Hello STOP there", 11, ["STOP"], False) == ("STOP", 6)
    assert find_stop_string("Hello STOP there", 11, ["STOP"], True) == ("STOP", 10)


def test_stop_search_only_covers_new_text() -> None:
    # "STOP" lies wholly in text that was already checked: not reported again.
    assert find_stop_string("xxSTOPyy", 2, ["STOP"], False) is None
    # The last char of the stop string arrives now.
    assert find_stop_string("xxSTOP", 1, ["STOP"], False) == ("STOP", 2)
    assert find_stop_string("abc", 0, ["abc"], False) is None
    assert find_stop_string("abc", 1, [], False) is None


def test_earliest_stop_string_wins() -> None:
    assert find_stop_string("Hello", 5, ["lo", "Hel"], False) == ("Hel", 0)
    assert find_stop_string("abcd", 4, ["abc", "ab"], True) == ("ab", 2)


@given(
    text=st.text("abc", max_size=30),
    stop=st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    include=st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_property_stop_found_at_first_completion(text, stop, cuts, include) -> None:
    pieces, pos, k = [], 0, 0
    while pos < len(text):
        pieces.append(text[pos : pos + cuts[k % len(cuts)]])
        pos += cuts[k % len(cuts)]
        k += 1
    first_end = min((text.find(s) + len(s) for s in stop if s in text), default=None)
    final, matched, step = _stream_stop(pieces, stop, include)
    if first_end is None:
        assert matched is None and final == text
        return
    ends = [sum(len(p) for p in pieces[: i + 1]) for i in range(len(pieces))]
    assert step == next(i for i, e in enumerate(ends) if e >= first_end)
    kept = final[: len(final) - len(matched)] if include else final
    assert include or not any(s in kept for s in stop)
    if include:
        assert final.endswith(matched)
    assert text.startswith(final)


def test_holdback() -> None:
    assert stop_string_holdback("Hello ST", ["STOP"]) == 2
    assert stop_string_holdback("Hello S", ["STOP"]) == 1
    assert stop_string_holdback("Hello STOP", ["STOP"]) == 0  # a full match is not a proper prefix
    assert stop_string_holdback("Hello", ["STOP"]) == 0
    assert stop_string_holdback("xab", ["ab", "abc"]) == 2
    assert stop_string_holdback("xa", ["zzz", "ab"]) == 1
    assert stop_string_holdback("", ["ab"]) == 0
    assert stop_string_holdback("aaa", ["aaaa"]) == 3
    assert stop_string_holdback("abc", []) == 0


@given(text=st.text("ab", max_size=12), stop=st.lists(st.text("ab", min_size=1, max_size=5), max_size=3))
@settings(max_examples=300, deadline=None)
def test_property_holdback_is_longest_proper_prefix(text, stop) -> None:
    expected = max(
        (k for s in stop for k in range(1, len(s)) if k <= len(text) and text.endswith(s[:k])), default=0
    )
    assert stop_string_holdback(text, stop) == expected


def test_prompt_ending_mid_character(tokenizer) -> None:
    """A prompt whose last token is half a character must not leak bytes into the output."""
    zh = tokenizer.encode("你")
    assert len(zh) == 2 and tokenizer.decode(zh[:1]).endswith("\ufffd")
    det = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi ") + zh[:1])
    out = zh[1:] + tokenizer.encode(" ok")
    assert "".join(det.add_tokens([t]) for t in out) == tokenizer.decode(out)
