"""Attach to running vLLM / SGLang servers, read-only: KV cache events over ZMQ and Prometheus metrics.

Everything here is Qt-free and torch-free (an import-linter contract and tests/attach/test_attach_torchfree.py hold
it to that): `events` decodes frames, `subscriber` reads one publisher (sequence gaps, replay), `block_state`
and `cluster` turn events into per-endpoint / rank / medium block tables with numpy views for the window,
`metrics` scrapes /metrics, `session` ties them together, `recorder` writes a trace for the policy lab, and
`fake/` stands in for a server in tests and benches.
"""
