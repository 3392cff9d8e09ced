"""The OpenAI-compatible server: wire models (protocol), routes (server) and Prometheus metrics."""
