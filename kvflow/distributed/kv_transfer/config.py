"""`--kv-transfer-config '{"kv_role": "kv_producer" | "kv_consumer", ...}'`, checked once at start-up."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

ROLES = ("kv_producer", "kv_consumer")


@dataclass(frozen=True)
class KVTransferConfig:
    """A producer (prefill instance) streams a prompt's blocks on `kv_host:kv_port` as its prefill
    computes them; a consumer (decode instance) subscribes for a request that names the producer,
    waiting at most `kv_timeout_s` in all (the prefill included: the router sends both at once,
    hence the default, the router's --prefill-timeout) before it computes the rest itself."""

    kv_role: str
    kv_connector: str = "ZmqConnector"
    kv_host: str = "127.0.0.1"
    kv_port: int = 0  # producer: 0 picks a free port (announced at GET /kv_transfer)
    kv_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.kv_role == "kv_both":
            raise ValueError("kv_transfer_config.kv_role: kv_both is not supported; use kv_producer or kv_consumer")
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {', '.join(ROLES)}, got {self.kv_role!r}")
        if self.kv_connector != "ZmqConnector":
            raise ValueError(f"kv_transfer_config.kv_connector: only ZmqConnector exists, got {self.kv_connector!r}")
        if not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config.kv_port must be a port number in [0, 65536), got {self.kv_port!r}")
        if not isinstance(self.kv_timeout_s, (int, float)) or not self.kv_timeout_s > 0:
            raise ValueError(f"kv_transfer_config.kv_timeout_s must be > 0 seconds, got {self.kv_timeout_s!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role == "kv_producer"

    @classmethod
    def parse(cls, text: str | dict[str, Any]) -> "KVTransferConfig":
        try:
            data = json.loads(text) if isinstance(text, str) else dict(text)
        except ValueError as exc:
            raise ValueError(f"--kv-transfer-config: not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("--kv-transfer-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        if "kv_role" not in data:
            raise ValueError("kv_transfer_config.kv_role is required (kv_producer or kv_consumer)")
        return cls(**data)
