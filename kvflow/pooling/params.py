"""What an embedding request asks for, with vLLM's names.

`PoolerConfig` is the engine's choice (one per server, as in vLLM): which hidden states make
the vector and whether it is L2-normalised. `PoolingParams` is the request's: how many leading
dimensions to keep (Matryoshka models only) and whether to normalise, overriding the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvflow.config import config_object
from kvflow.sampling.params import check_truncate_prompt_tokens

# LAST: the final prompt position's hidden state (what decoder-only embedding models such as
# e5-mistral or gte-Qwen are trained for, and vLLM's default for a causal LM run as an embedder);
# MEAN: the average over every prompt position.
POOLING_TYPES = ("LAST", "MEAN")


@dataclass(frozen=True)
class PoolerConfig:
    """How a prompt's final-norm hidden states become one vector."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
            raise ValueError(f"pooler_config: pooling_type {self.pooling_type!r} is not supported; "
                             f"choose one of {', '.join(POOLING_TYPES)}")
        object.__setattr__(self, "pooling_type", self.pooling_type.upper())
        if not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config: normalize must be true or false, got {self.normalize!r}")

    @classmethod
    def parse(cls, value: "PoolerConfig | dict[str, Any] | str | None") -> "PoolerConfig":
        """A config from `LLM(pooler_config=...)` or `--pooler-config '{"pooling_type": "MEAN"}'`."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        return cls(**config_object(value, "pooler_config", cls))


@dataclass
class PoolingParams:
    """Per request: `dimensions` keeps the leading dimensions of a Matryoshka embedding (then
    normalises, when normalising); `normalize` overrides the pooler config's choice (None: keep it);
    `truncate_prompt_tokens` embeds only the prompt's last tokens."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: max_model_len), as vLLM

    def check(self, hidden_size: int, is_matryoshka: bool, matryoshka_dimensions: list[int] | None) -> None:
        """ValueError naming the field when the model cannot give what is asked."""
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true, false or null, got {self.normalize!r}")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        d = self.dimensions
        if d is None:
            return
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(f"dimensions must be a positive integer, got {d!r}")
        if not is_matryoshka:
            # Cutting a vector the model was not trained to cut keeps an arbitrary slice of it.
            raise ValueError("dimensions: this model does not support Matryoshka embeddings (its config.json "
                             "declares neither is_matryoshka nor matryoshka_dimensions); leave dimensions unset")
        if matryoshka_dimensions and d not in matryoshka_dimensions:
            raise ValueError(f"dimensions: {d} is not one the model was trained for; choose one of "
                             f"{', '.join(map(str, matryoshka_dimensions))}")
        if d > hidden_size:
            raise ValueError(f"dimensions: {d} is more than the model's {hidden_size}")
