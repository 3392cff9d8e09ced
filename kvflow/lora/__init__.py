"""LoRA adapters served over one base model (vLLM's multi-LoRA serving).

  request.py   `LoRARequest`: which adapter a request runs with (vLLM's name and fields)
  adapter.py   reads a PEFT adapter folder into per-layer A/B pairs in kvflow's fused shapes
  layers.py    `LoRALinear`: a base `Linear` plus the step's adapters' low-rank deltas
  manager.py   `LoRAManager`: wraps the model's projections, holds the loaded adapters, and
               tells the layers which rows of each step run which adapter
"""

from kvflow.lora.request import LoRAConfig, LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
