"""Attention over the paged KV cache, behind one interface.

A backend reads one tier's K/V where the pool keeps them (`PagedKV`: the codec parts, see engine/kv/codecs.py)
through a block table, and returns the attention output. Three backends, checked against each other on every
block size and storage format (tests/attention/test_paged_attention.py, test_numba_paged.py):

| name        | module          | how                                                                        |
|-------------|-----------------|----------------------------------------------------------------------------|
| `reference` | `reference.py`  | today's model path: codec.decode of the whole table, permute, SDPA + mask  |
| `cpu`       | `numba_paged.py` | `numba` when numba imports (else `chunked`): a compiled loop per          |
|             |                 | (sequence, kv head) reading each block's K/V bytes once in place,          |
|             |                 | dequantized in a block buffer, online softmax; CPU prefill and CUDA        |
|             |                 | tensors go to `chunked`                                                    |
| `chunked`   | `cpu_paged.py`  | torch ops in chunks of blocks, gathered head-major (no permute copy),      |
|             |                 | dequantized per chunk, online softmax; runs on any device                  |
| `triton`    | `triton_paged.py` | a paged-decode kernel: one program per (sequence, kv head), K/V          |
|             |                 | dequantized in registers; prefill falls back to the `cpu` path             |

`check.check_backend` runs a backend beside the reference on scratch K/V of a given format and block size (the
attention self-check at first use, engine/runtime/self_check.py).

The reference's SDPA under a visibility mask is `reference.dense_attention`, written once: ReferenceBackend
runs it in fp32 over the decoded table, and the model's inline `reference` path (engine/model/llama_family.py,
no backend object: it reads through its KVStore) runs it in the weights dtype.

Shapes: B sequences, Q queries each (1 for decode), H query heads, Hkv kv heads (H % Hkv == 0; query
head h reads kv head h // (H // Hkv)), D head dim, NB blocks per table row, bs block size.

Visibility (the model's `_mask`): key i of row b is visible to a query at position p iff
i < context_lens[b], key_pos[b, i] <= p and, with a window, key_pos[b, i] > p - window. Every query must
see at least one key (a row with none is undefined: NaN in the reference).

Attention sinks (GPT-OSS): decode and prefill take `sinks` [H], a logit per head that joins each softmax's
denominator as a key whose value is 0 (the rows' weights then sum to less than 1). Every backend honours them;
a partial never includes them: they join once, after the merge (tier_split.add_sinks).

Blocks on the host tier (PagedBatch.on_host) are read in one of two ways (the host_reads knob): streamed
(copied as stored to a staging buffer on the compute device one layer ahead, host_stream.py, and read there by
`read_blocks`), or
attended where they are (host_reads="compute", tier_split.py): each backend's `partial` returns (output, lse)
over one tier's keys, the host part runs on the CPU, and the two are merged by log-sum-exp. A partial is defined
for every row: one with no visible key gives output 0 and lse -inf.
"""

from __future__ import annotations

from engine.attention.interface import (AttentionBackend, DecodeAsPrefill, KVFormat, PagedBatch, PagedKV,
                                        kv_formats)
from engine.attention.reading import key_positions, query_positions, read_blocks, visibility

__all__ = ["AttentionBackend", "DecodeAsPrefill", "KVFormat", "PagedBatch", "PagedKV", "kv_formats", "key_positions",
           "query_positions", "read_blocks", "visibility", "make_backend"]


def make_backend(name: str, **options) -> AttentionBackend:
    """'reference', 'cpu', 'chunked' or 'triton' (imports triton only when asked for).

    cpu: the numba loop (`numba`, numba_paged.py) when numba imports, else the chunked torch path; chunked: always
    the chunked torch path (cpu_paged.py), the numba backend's fallback when its self-check fails."""
    if name == "reference":
        from engine.attention.reference import ReferenceBackend

        return ReferenceBackend(**options)
    if name == "cpu":
        from engine.attention import numba_paged

        if numba_paged.available():
            return numba_paged.NumbaPagedBackend(**options)
        name = "chunked"
    if name == "chunked":
        from engine.attention.cpu_paged import ChunkedPagedBackend

        return ChunkedPagedBackend(**options)
    if name == "triton":
        from engine.attention.triton_paged import TritonPagedBackend

        return TritonPagedBackend(**options)
    raise ValueError(f"attention backend {name!r}: choose reference, cpu, chunked or triton")
