"""One entry point for tokenizers, whatever the model argument was: a HF directory or a .gguf file.

Nothing here may reach the network: a server started offline must not stall on hub look-ups,
and weights and tokenizers are never downloaded.
"""

from __future__ import annotations

import copy
import functools
import glob
import os
import re
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
            return load_gguf_tokenizer(path)
        if os.path.basename(path) == "config.json":
            path = os.path.dirname(path) or "."
        else:
            raise ValueError(f"tokenizer: {model_path!r} is a file but not a .gguf; pass its directory instead")
    if not any(os.path.isfile(os.path.join(path, name)) for name in _HF_TOKENIZER_FILES):
        ggufs = glob.glob(os.path.join(path, "*.gguf"))
        if len(ggufs) == 1:  # a directory holding just one GGUF: use the tokenizer inside it
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


def load_gguf_tokenizer(path: str) -> Any:
    """A transformers fast tokenizer rebuilt from the GGUF's vocabulary, merges and chat template.

    `PreTrainedTokenizerFast` is used directly: `AutoTokenizer` would first build a whole
    `AutoConfig` from the file (another full metadata parse, ~2-4 s) only to pick a class.
    Each call returns a tokenizer of its own (a copy of the first one built from this file, as
    it is on disk now: 0.2 s instead of 1.4 s for the default model's), so no caller sees
    another's changes to it.
    """
    from kvflow.loader.gguf_loader import gguf_architecture

    gguf_architecture(path)  # validates the file with a clear error before transformers reads it
    path = os.path.abspath(path)
    stat = os.stat(path)
    return copy.deepcopy(_built_tokenizer(path, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=4)
def _built_tokenizer(path: str, mtime_ns: int, size: int) -> Any:
    """The tokenizer transformers converts from the GGUF at `path` (mtime and size: its version)."""
    from transformers import PreTrainedTokenizerFast

    from kvflow.loader.gguf_loader import read_gguf_metadata

    try:
        tok = PreTrainedTokenizerFast.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True
        )
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"model: cannot build a tokenizer from {path}: {e}") from e
    template = read_gguf_metadata(path).get("tokenizer.chat_template")
    if isinstance(template, str) and tok.chat_template != template:
        tok.chat_template = template  # transformers copies it today; make sure it always does
    return tok


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet read back: each of its 256 characters to the byte it stands for."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """A token's own bytes, which may be part of a UTF-8 character (an emoji is often three
    tokens): OpenAI's logprobs `bytes`, from which a client rebuilds such a character. Decoding
    the token alone gives U+FFFD for those. Byte-level BPE pieces map back through their
    alphabet, SentencePiece's byte fallback <0xNN> is its byte; anything else is its text."""
    from tokenizers import decoders

    piece = tokenizer.convert_ids_to_tokens(token_id)
    fallback = _BYTE_FALLBACK.fullmatch(piece or "")
    if fallback:
        return bytes.fromhex(fallback.group(1))
    alphabet = _byte_level_alphabet()
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if isinstance(decoder, decoders.ByteLevel) and piece and all(c in alphabet for c in piece):
        return bytes(alphabet[c] for c in piece)
    return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False).encode("utf-8")
