"""What a request asks of the LoRA subsystem, and how many adapters the engine serves at once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """One adapter, as vLLM names it: `lora_int_id` identifies it in the engine (positive, one
    adapter per id), `lora_name` is what clients call it, `lora_path` its PEFT folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    @property
    def cache_key(self) -> str:
        """What the prefix cache keys this adapter's K/V by: its id and its folder."""
        return f"{self.lora_int_id}:{self.lora_path}"

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")


@dataclass(frozen=True)
class LoRAConfig:
    """vLLM's options: adapters in one batch (`max_loras`), the largest rank accepted, and how many
    loaded adapters stay in memory when no request uses them (`max_cpu_loras`, default `max_loras`)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int)
                                               or self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), "
                             f"got {self.max_cpu_loras!r}")

    @property
    def cache_size(self) -> int:
        return self.max_cpu_loras or self.max_loras
