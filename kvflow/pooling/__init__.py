"""Embeddings: pooling a prompt's hidden states into one vector (`LLM.embed`, /v1/embeddings)."""

from kvflow.pooling.params import POOLING_TYPES, PoolerConfig, PoolingParams

__all__ = ["POOLING_TYPES", "PoolerConfig", "PoolingParams"]
