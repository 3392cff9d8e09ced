"""The engine core in its own process: `kvflow serve`'s engine loop, off the API server's GIL.

`process.py` is the core's side (an `AsyncEngine` driven over ZMQ, making token ids only),
`client.py` the API server's side (an `AsyncEngine`-shaped proxy), `assembler.py` the API side's
detokenization and stop strings, `wire.py` what crosses between them (msgpack).
"""
