"""Speculative decoding: proposers guess tokens, the target verifies them in the normal step."""

from kvflow.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
