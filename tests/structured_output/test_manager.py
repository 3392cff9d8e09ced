"""The compiled-grammar cache, grammar states and bitmasks, on the default model's tokenizer."""

from __future__ import annotations

import threading

import pytest
import torch

from kvflow.sampling.bitmask import unpack_bitmask
from kvflow.structured_output.backend import StructuredOutputError, choice_grammar
from kvflow.structured_output.manager import StructuredOutputManager, fill_token_bitmask
from kvflow.structured_output.params import StructuredOutputsParams

EXTRA_IDS = 64  # the model's vocabulary may be wider than the tokenizer's; those ids must never be allowed


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    from kvflow.loader.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_gguf)


@pytest.fixture(scope="module")
def vocab(tokenizer) -> int:
    return len(tokenizer) + EXTRA_IDS


@pytest.fixture(scope="module")
def manager(tokenizer, vocab) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer, vocab, [tokenizer.eos_token_id])


def allowed_ids(state, vocab: int) -> list[int]:
    (rows, bitmask) = fill_token_bitmask([state], vocab)
    assert rows.tolist() == [0]
    return unpack_bitmask(bitmask, vocab)[0].nonzero().flatten().tolist()


def test_cache_reuses_compiled_grammars_and_is_bounded(tokenizer, vocab):
    m = StructuredOutputManager(tokenizer, vocab, [tokenizer.eos_token_id], cache_size=2)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("[0-9]+", "[a-z]+", "x|y"))
    first = m.compile(a)
    assert m.compile(StructuredOutputsParams(regex="[0-9]+")) is first  # equal constraint, same grammar
    assert (m.stats.hits, m.stats.misses) == (1, 1)
    m.compile(b)
    m.compile(c)  # evicts a, the least recently used
    assert m.stats.size == 2
    assert m.compile(a) is not first and m.stats.misses == 4


def test_concurrent_requests_for_one_schema_compile_it_once(tokenizer, vocab):
    m = StructuredOutputManager(tokenizer, vocab, [tokenizer.eos_token_id])
    schema = StructuredOutputsParams(json={"type": "object", "properties": {f"k{i}": {"type": "string"}
                                                                            for i in range(30)}})
    results = []
    threads = [threading.Thread(target=lambda: results.append(m.compile(schema))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 6 and all(r is results[0] for r in results)
    assert (m.stats.misses, m.stats.hits) == (1, 5)


@pytest.mark.parametrize(("params", "field"), [
    (StructuredOutputsParams(regex="(ab"), "regex"),
    (StructuredOutputsParams(grammar="root ::= "), "grammar"),
    (StructuredOutputsParams(grammar='start ::= "a"'), "grammar"),  # no root rule
    (StructuredOutputsParams(json={"type": "no-such-type"}), "json"),
])
def test_what_does_not_compile_is_a_clear_error(manager, params, field):
    with pytest.raises(StructuredOutputError, match=f"structured_outputs.{field}: invalid") as info:
        manager.compile(params)
    assert info.value.field == field
    with pytest.raises(StructuredOutputError):  # failures are not cached as successes
        manager.compile(params)


def test_choice_allows_exactly_the_prefixes_then_only_eos(manager, tokenizer, vocab):
    choices = ["yes", "no", 'say "hi"\n']
    state = manager.new_state(StructuredOutputsParams(choice=choices))
    first = allowed_ids(state, vocab)
    assert first and max(first) < len(tokenizer)  # never an id past the tokenizer
    for t in first:
        text = tokenizer.decode([t])
        assert text and any(c.startswith(text) for c in choices), f"token {t} {text!r} is no choice's prefix"
    for t in tokenizer('say "hi"\n', add_special_tokens=False).input_ids:
        assert state.accept(t)
    assert allowed_ids(state, vocab) == [tokenizer.eos_token_id] and not state.is_terminated
    assert not state.accept(tokenizer("x", add_special_tokens=False).input_ids[0])  # refused, state unchanged
    assert state.accept(tokenizer.eos_token_id) and state.is_terminated


def test_choice_grammar_escapes_its_strings():
    assert choice_grammar(['a"b', "c\\d", "e\nf"]) == r'root ::= "a\"b" | "c\\d" | "e\nf"'


def test_bitmask_rows_follow_the_batch(manager, vocab, tokenizer):
    digits = manager.new_state(StructuredOutputsParams(regex="[0-9]{3}"))
    rows, bitmask = fill_token_bitmask([None, digits, None], vocab)
    assert rows.tolist() == [1] and bitmask.shape == (1, (vocab + 31) // 32) and bitmask.dtype == torch.int32
    allowed = unpack_bitmask(bitmask, vocab)[0].nonzero().flatten().tolist()
    assert allowed and all(tokenizer.decode([t]).isdigit() for t in allowed)
    assert fill_token_bitmask([None, None], vocab) is None
