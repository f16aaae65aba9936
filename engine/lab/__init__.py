"""Offline experiments on what the engine recorded: the policy lab and the KV-format quality bench.

`policy_sim` (the eviction policies replayed over an access trace), `policy_lab` (capacities swept, tables),
`quality` (a lossless and a lossy cache run on the same tokens, logits compared). The command lines and
plots are in app/.
"""
