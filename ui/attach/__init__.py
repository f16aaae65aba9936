"""The attach window: the caches of running vLLM / SGLang servers, drawn from their KV events and /metrics.

`codes` (the groups' codes in one image), `block_map` (`AttachMap`), `panels` (metrics, stream health,
events), `dialog` (File -> Attach...), `window` (`AttachWindow`). Reads engine.attach frames only.
"""
