"""The KV cache itself: where every block's K and V live, who holds them, and which go when room runs out.

Layers, lowest first (a module imports only those above it in this list, and nothing outside engine.kv but
engine.config / engine.errors / engine.sequence / engine.user_file):

- `codecs`: the storage formats (fp32 / fp16 / 8-bit values / delta keys) as parts arrays, encode and decode.
- `tiers`: one tier's slab of fixed-size slots (`TierPool`: device or host memory, per-slot metadata arrays).
- `eviction`: the policies (LRU-K, heat, S3-FIFO) that pick victims from a tier's read-only arrays;
  `eviction_sim` the same rules in plain Python over a key trace (and Belady's OPT) for the policy lab, held to the
  engine's victims by a parity test over random traces (tests/lab/test_policy_lab.py).
- `block_pool`: `BlockPool`, both tiers and the logical block ids mapped onto their slots; ref counts,
  prefix cache, migrations between tiers; `invariants` checks it; `copy_check` verifies a pool's first tier copy
  byte for byte (the migration self-check, engine/runtime/self_check.py).
- `resize` / `resize_undo`: a budget change applied in place, and its undo journal.
- `residency`: `Residency`, where blocks are when a step runs (room, promotion with prefetch, idle demotion,
  copy-on-write, swap-out); `manager`: `KVManager`, one KV-cache group's pool and what is done to it by sequence
  (prefix matching, hashing, sharing, re-laying a tail, release; it holds a `Residency`), and `relayout` for a change
  of block size or dtype; `groups`: the model's layers grouped by what their attention keeps.
- `cache`: `KVCache`, the one door the engine, scheduler and model runner use: a KVManager per KV-cache group (one
  group of every layer is the plain case), the budget rules and config changes (`check_change` / `apply_change`).
- `access_trace`: every block read, recorded for the policy lab.
"""
