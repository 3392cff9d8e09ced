"""The KV connector over ZMQ/TCP: which half a role runs, and the request-level entry points.

The producer (`producer.ZmqKVServer`) streams a prompt's full blocks to a subscribed consumer
after each prefill step that completes some; the consumer (`consumer.ZmqKVConnector`) subscribes
before it adds the request and loads the blocks as they come. `prepare_kv_transfer` is what
`AsyncEngine.add_request` calls for a request's `kv_transfer_params`; `kv_transfer_info` is
GET /kv_transfer.
"""

from __future__ import annotations

from typing import Any

from kvflow.distributed.kv_transfer.config import KVTransferConfig
from kvflow.distributed.kv_transfer.consumer import ZmqKVConnector
from kvflow.distributed.kv_transfer.producer import ZmqKVServer
from kvflow.distributed.kv_transfer.stats import TransferStats  # noqa: F401 (its home before the split)


def make_connector(engine: Any, config: KVTransferConfig) -> ZmqKVServer | ZmqKVConnector:
    """The role's half, for an AsyncEngine (in the API server's process or in the engine core)."""
    return ZmqKVServer(engine, config) if config.is_producer else ZmqKVConnector(engine, config)


async def prepare_kv_transfer(engine: Any, prompt: Any, params: dict[str, Any]) -> None:
    """An AsyncEngine's check and load for a request's `kv_transfer_params` (vLLM's field), before the add.

    `do_remote_decode` (sent to a producer) needs nothing more: the prompt's blocks stay in its
    prefix cache. `do_remote_prefill` with `remote_kv_addr` (sent to a consumer) loads them first.
    """
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be an object")
    connector = getattr(engine, "kv_connector", None)
    if params.get("do_remote_decode"):
        if not isinstance(connector, ZmqKVServer):
            raise ValueError("kv_transfer_params.do_remote_decode: this instance is not a kv_producer "
                             "(start it with --kv-transfer-config '{\"kv_role\": \"kv_producer\"}')")
    if params.get("do_remote_prefill"):
        if not isinstance(connector, ZmqKVConnector):
            raise ValueError("kv_transfer_params.do_remote_prefill: this instance is not a kv_consumer "
                             "(start it with --kv-transfer-config '{\"kv_role\": \"kv_consumer\"}')")
        _, ids = engine.engine.tokenize(prompt)
        await connector.prepare_request(engine, ids, params)


def kv_transfer_info(engine: Any) -> dict[str, Any] | None:
    """GET /kv_transfer: the role, the producer's address, the transfer counters."""
    connector = getattr(engine, "kv_connector", None)
    if connector is None:
        return None
    return {"kv_role": connector.config.kv_role, "kv_addr": getattr(connector, "address", None),
            "stats": vars(connector.stats).copy()}
