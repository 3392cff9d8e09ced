"""SamplingParams: vLLM defaults, normalisation, and validation messages that name the field."""

from __future__ import annotations

import re

import pytest

from kvflow.sampling.params import SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert p.seed is None
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens) == (16, 0)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.ignore_eos is False and p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens is True and p.include_stop_str_in_output is False
    assert not p.is_greedy and not p.has_penalties


def test_normalisation() -> None:
    p = SamplingParams(top_k=-1, stop="###", stop_token_ids=(7, 9))
    assert p.top_k == 0
    assert p.stop == ["###"]
    assert p.stop_token_ids == [7, 9]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(max_tokens=None).max_tokens is None


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"n": 10**6}, "n"),
        ({"n": 2.0}, "n"),
        ({"n": True}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "42"}, "seed"),
        ({"seed": True}, "seed"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 1.0}, "prompt_logprobs"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logit_bias": {"dog": 1}}, "logit_bias"),
        ({"logit_bias": [5, 1]}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [3, -1]}, "allowed_token_ids"),
        ({"allowed_token_ids": [1.5]}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"bad_words": [3]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens"),
    ],
)
def test_validation_error_names_parameter(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}\b") as info:
        SamplingParams(**kwargs)
    # "top_p" must not be reported as "top_k" etc.: the first word is exactly the field.
    assert str(info.value).split(" ")[0] == name


def test_logit_edits_normalised() -> None:
    p = SamplingParams(logit_bias={"15339": -100, 7: 2.5}, allowed_token_ids=(4, 5), bad_words="hello")
    assert p.logit_bias == {15339: -100, 7: 2.5}
    assert p.allowed_token_ids == [4, 5] and p.bad_words == ["hello"]
    assert p.edits_logits and p.reads_output
    assert SamplingParams(logit_bias={1: 0.0}).edits_logits and not SamplingParams(logit_bias={1: 0.0}).reads_output
    assert not SamplingParams(logit_bias={}).edits_logits
    assert not SamplingParams().edits_logits and not SamplingParams().reads_output


def test_n_range() -> None:
    assert SamplingParams(n=3).n == 3 and SamplingParams(n=128).n == 128
    with pytest.raises(ValueError, match=re.escape("n must be an int in [1, 128], got 1000000")):
        SamplingParams(n=10**6)


def test_top_p_message_format() -> None:
    with pytest.raises(ValueError, match=re.escape("top_p must be in (0, 1], got 1.5")):
        SamplingParams(top_p=1.5)


def test_boundaries_accepted() -> None:
    SamplingParams(temperature=0, top_p=1.0, top_k=0, min_p=1.0, presence_penalty=-2, frequency_penalty=2)
    SamplingParams(min_tokens=16, max_tokens=16, logprobs=0, seed=0)
    SamplingParams(logprobs=20, min_tokens=100, max_tokens=None)
    SamplingParams(prompt_logprobs=0)
    SamplingParams(prompt_logprobs=20, logprobs=0)


def test_prompt_logprobs_message_format() -> None:
    with pytest.raises(ValueError, match=re.escape("prompt_logprobs must be in [0, 20] or None, got 21")):
        SamplingParams(prompt_logprobs=21)


@pytest.mark.parametrize(("temperature", "greedy"), [(0.0, True), (1e-6, True), (1e-4, False), (0.7, False)])
def test_is_greedy(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).is_greedy is greedy


def test_has_penalties() -> None:
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties


def test_repr_shows_only_non_defaults() -> None:
    assert repr(SamplingParams()) == "SamplingParams()"
    r = repr(SamplingParams(temperature=0.0, max_tokens=32, stop="x"))
    assert r == "SamplingParams(temperature=0.0, max_tokens=32, stop=['x'])"


# ---- unset versus explicit: what a model's defaults may replace ---------------------------------
def test_explicit_fields_are_the_ones_the_caller_named() -> None:
    assert SamplingParams().explicit_fields == frozenset()
    assert SamplingParams(max_tokens=8, temperature=1.0).explicit_fields == {"max_tokens", "temperature"}
    assert SamplingParams(1, 0.5).explicit_fields == {"n", "temperature"}  # positional, in field order
    p = SamplingParams()
    p.top_k = 5  # assigning later counts too
    assert p.explicit_fields == {"top_k"}


def test_with_defaults_fills_only_unset_fields() -> None:
    defaults = {"temperature": 0.2, "top_p": 0.9, "max_tokens": 64}
    filled = SamplingParams(max_tokens=8, stop="x").with_defaults(defaults)
    assert (filled.temperature, filled.top_p, filled.max_tokens, filled.stop) == (0.2, 0.9, 8, ["x"])
    # An explicit value equal to vLLM's default is still explicit: temperature=1.0 stays 1.0.
    kept = SamplingParams(temperature=1.0).with_defaults(defaults)
    assert (kept.temperature, kept.top_p, kept.max_tokens) == (1.0, 0.9, 64)
    # Defaults never become explicit, so a second layer still applies beneath the first.
    assert filled.explicit_fields == {"max_tokens", "stop"}
    assert SamplingParams().with_defaults({"top_k": -1}).with_defaults({"top_k": 7}).top_k == 7


def test_with_defaults_copies_and_validates() -> None:
    original = SamplingParams(stop=["a"])
    filled = original.with_defaults({"temperature": 0.3})
    assert original.temperature == 1.0 and filled is not original and filled.stop is not original.stop
    assert original.with_defaults({}) is original
    assert filled == SamplingParams(temperature=0.3, stop=["a"])  # equality looks at values only
    with pytest.raises(ValueError, match="^top_p"):
        SamplingParams().with_defaults({"top_p": 2.0})
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams().with_defaults({"do_sample": True})


def test_copies_track_their_own_explicit_fields() -> None:
    import copy
    import pickle

    original = SamplingParams(temperature=0.3)
    shallow = copy.copy(original)
    shallow.top_p = 0.5
    assert original.explicit_fields == {"temperature"} and shallow.explicit_fields == {"temperature", "top_p"}
    for clone in (copy.deepcopy(original), pickle.loads(pickle.dumps(original))):
        assert clone == original and clone.explicit_fields == {"temperature"}


def test_clone_is_deep_and_keeps_the_explicit_fields():
    """vLLM's SamplingParams.clone: a copy to change without touching the original."""
    params = SamplingParams(temperature=0.5, stop=["END"], stop_token_ids=[7])
    twin = params.clone()
    twin.stop.append("STOP")
    twin.stop_token_ids.append(8)
    assert params.stop == ["END"] and params.stop_token_ids == [7]
    assert twin.explicit_fields == params.explicit_fields and "temperature" in twin.explicit_fields
    assert twin.with_defaults({"temperature": 0.2, "top_p": 0.9}).top_p == 0.9
