"""Structured output: constrain a request's tokens to a JSON schema, regex, choice list or grammar.

`params.StructuredOutputsParams` is what a request carries (in `SamplingParams.structured_outputs`);
`manager.StructuredOutputManager` compiles it (cached) and keeps each sequence's grammar state;
the sampler applies the resulting token bitmask (`kvflow.sampling.bitmask`). Only `backend.py`
imports the grammar engine (xgrammar), and only when the first constrained request arrives.
"""

from kvflow.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
