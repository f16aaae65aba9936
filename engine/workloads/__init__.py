"""Requests to run: a built-in corpus, seedable generators and JSONL traces, and the live demo driver.

`corpus` (the text), `requests` (`Request`, generators, JSONL traces; no engine needed), `demo` (drives a
running engine from its thread). Only `demo` imports engine.runtime.
"""
