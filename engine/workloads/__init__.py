"""Requests to run: a built-in corpus, seedable generators and JSONL traces, and what drives an engine with them.

`corpus` (the text), `requests` (`Request`, generators, JSONL traces; no engine needed), `prompts` (a prompt's
token ids and whether the engine takes the request), `workload` (the `Workload` protocol the window's runner
drives), `demo` (the live demo), `replay` (a request list replayed on an engine by arrival time, for the benches),
`trace_workload` (a trace replayed live in the window, round after round). Only `demo` and `replay` import
engine.runtime, and only when they run.
"""
