"""One entry point for tokenizers, whatever the model argument was: a HF directory or a .gguf file.

Nothing here may reach the network: a server started offline must not stall on hub look-ups,
and weights and tokenizers are never downloaded.
"""

from __future__ import annotations

import glob
import os
from typing import Any

_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _is_gguf_file(path: str) -> bool:
    if path.endswith(".gguf"):
        return True
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def load_tokenizer(model_path: str) -> Any:
    """A transformers tokenizer (with its chat template) for a HF model directory or a .gguf file."""
    path = os.path.expanduser(model_path)
    if not os.path.exists(path):
        raise ValueError(f"tokenizer: {model_path!r} does not exist; pass a Hugging Face model directory or a .gguf file")
    if os.path.isfile(path):
        if _is_gguf_file(path):
            from kvflow.loader.gguf_loader import load_gguf_tokenizer

            return load_gguf_tokenizer(path)
        if os.path.basename(path) == "config.json":
            path = os.path.dirname(path) or "."
        else:
            raise ValueError(f"tokenizer: {model_path!r} is a file but not a .gguf; pass its directory instead")
    if not any(os.path.isfile(os.path.join(path, name)) for name in _HF_TOKENIZER_FILES):
        ggufs = glob.glob(os.path.join(path, "*.gguf"))
        if len(ggufs) == 1:  # a directory holding just one GGUF: use the tokenizer inside it
            from kvflow.loader.gguf_loader import load_gguf_tokenizer

            return load_gguf_tokenizer(ggufs[0])
        raise ValueError(
            f"tokenizer: {model_path!r} has no tokenizer files ({', '.join(_HF_TOKENIZER_FILES)}) "
            "and not exactly one .gguf file"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"tokenizer: cannot load a tokenizer from {model_path!r}: {e}") from e
