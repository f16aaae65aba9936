"""What a lossy KV format costs, measured while the engine runs.

`block_error`: each block's K/V reconstruction error as written (per layer, relative), kept beside the block;
`shadow`: sampled shadow steps, one sequence's step recomputed with lossless K/V and compared (KL, flips,
max logit error). Imports engine.kv and engine.model; engine.runtime calls it.
"""
