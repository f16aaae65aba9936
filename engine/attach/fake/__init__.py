"""Stand-ins for a vLLM / SGLang server in tests and benches: never used when attaching to a real one.

`workload` (a stream of KV events like a server's), `publisher` (publishes it over ZMQ in either server's
wire format, with a replay socket and /metrics), `spawn` (starts publishers as child processes and reads
what they report).
"""
