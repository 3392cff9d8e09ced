"""Moving a prompt's KV cache between instances: prefill/decode disaggregation.

- `config.py`: `--kv-transfer-config` (vLLM's shape: kv_role, and where to listen or how long to wait).
- `base.py`: the connector interface, a scheduler side (which blocks to receive and when the
  request may run) and a worker side (reading and writing blocks of the pool).
- `blocks.py`: the worker side on kvflow's pool: whole prompt blocks read out of, and written into,
  the prefix cache, between two engine steps.
- `producer.py`: the producer's block server over ZMQ/TCP, streaming each prefill step's new full
  blocks to the subscribed consumer; `consumer.py`: the consumer's subscription, loading them as
  they come; `stats.py`: their counters.
- `zmq_connector.py`: which half a role runs, and the request-level entry points.
"""
