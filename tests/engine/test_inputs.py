"""engine/inputs.py: prompts as the engine takes them."""

import numpy as np
import pytest
import torch

from kvflow.engine.inputs import token_id_list, tokenize_prompt


@pytest.mark.parametrize("ids", [[3, 1, 2], (3, 1, 2), np.array([3, 1, 2]), np.array([3, 1, 2], dtype=np.int32),
                                 torch.tensor([3, 1, 2]), [np.int64(3), 1, 2]])
def test_token_ids_from_any_integer_sequence(ids):
    out = token_id_list(ids)
    assert out == [3, 1, 2] and all(type(t) is int for t in out)
    assert tokenize_prompt(None, {"prompt_token_ids": ids}) == (None, [3, 1, 2])


@pytest.mark.parametrize("ids", [[1.9], np.array([1.0, 2.0]), torch.tensor([1.0]), [True], ["1"], "12", 7, None])
def test_non_integer_token_ids_are_refused_not_truncated(ids):
    with pytest.raises(ValueError, match="^prompt: "):
        token_id_list(ids)


@pytest.mark.parametrize(("prompt", "words"), [
    ({"prompt": "Describe the image:", "multi_modal_data": {"image": object()}},
     "multi_modal_data: kvflow serves text-only"),
    ({"prompt_token_ids": [1, 2], "prompt_embeds": torch.zeros(2, 4)}, "prompt_embeds: kvflow serves text-only"),
    ({"prompt": "Hi", "mm_processor_kwargs": {}}, "mm_processor_kwargs"),
    ({"prompt": "Hi", "promt_token_ids": [1]}, "unknown key\\(s\\) 'promt_token_ids'; a dict prompt takes prompt"),
])
def test_keys_that_would_be_ignored_are_refused(prompt, words):
    """Before: an image was dropped without a word and the model described a picture it never saw."""
    with pytest.raises(ValueError, match=words):
        tokenize_prompt(None, prompt)
    assert tokenize_prompt(None, {"prompt_token_ids": [4], "cache_salt": "s"}) == (None, [4])
    assert tokenize_prompt(None, {"prompt_token_ids": [4], "multi_modal_data": None}) == (None, [4])  # nothing lost
