"""A bad speculative_config is refused at start-up with a message naming the field."""

from __future__ import annotations

import pytest

from kvflow.spec_decode.config import SpeculativeConfig


@pytest.mark.parametrize("value, field", [
    ({"method": "medusa", "num_speculative_tokens": 3}, "method"),
    ({"num_speculative_tokens": 3}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}, "lookahead"),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": "x"}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "draft_model", "num_speculative_tokens": 3, "model": "x", "quantize_lm_head": "yes"}, "quantize_lm_head"),
    ("{not json", "speculative_config"),
    ([1, 2], "speculative_config"),
])
def test_bad_configs_name_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.parse(value)


def test_json_and_dict_forms_agree():
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'
    assert SpeculativeConfig.parse(text) == SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5})
    assert SpeculativeConfig.parse(None) is None


def test_engine_config_refuses_a_bad_config_before_loading():
    from kvflow.config import EngineConfig

    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": -1})


def test_numpy_counts_become_python_ints():
    """As EngineConfig does: numpy's ints overflow in arithmetic and JSON refuses them."""
    import json

    import numpy as np

    cfg = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": np.int64(3),
                                   "prompt_lookup_max": np.int32(5), "disable_by_batch_size": np.int16(8)})
    assert [type(v) for v in (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.disable_by_batch_size)] == [int] * 3
    json.dumps([cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.disable_by_batch_size])
