"""Offline experiments on what the engine recorded: the policy lab and the KV-format quality bench.

`policy_lab` (capacities swept over engine.kv.eviction_sim's replay of a trace, tables),
`quality` (a lossless and a lossy cache run on the same tokens, logits compared). The command lines and
plots are in app/.
"""
