"""kvflow: an LLM inference and serving engine with a paged KV cache and continuous batching."""

from kvflow.config import EngineConfig
from kvflow.entrypoints.llm import LLM
from kvflow.lora.request import LoRARequest
from kvflow.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, PoolingOutput,
                            PoolingRequestOutput, RequestOutput)
from kvflow.pooling.params import PoolerConfig, PoolingParams
from kvflow.sampling.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from kvflow.sampling.params import SamplingParams
from kvflow.structured_output.params import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "PoolingParams", "PoolerConfig",
           "EngineConfig", "RequestOutput", "CompletionOutput", "Logprob", "PoolingRequestOutput", "PoolingOutput",
           "EmbeddingRequestOutput", "EmbeddingOutput", "BeamSearchParams", "BeamSearchOutput",
           "BeamSearchSequence", "__version__"]
