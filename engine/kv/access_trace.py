"""Block-access traces: every block read by attention, with time, sequence, tier and hit/miss.

A trace is what the policy lab replays. Blocks are named by a serial number given at allocation, unique
for the engine's lifetime (a block keeps it across migrations and prefix reuse; a re-laid block gets a new
one), so a replay sees exactly the reuse the engine saw. Saved as .npz with one array per column.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
from numpy.lib import format as npy_format

from engine.user_file import UserFileError, open_regular

COLUMNS = ("t", "seq", "block", "tier", "hit")
# Columns a trace may lack (traces saved before them still load): per row, `pos` (the block's index in its
# sequence, counted from its first token: a sliding-window group's table starts at its base; -1 unknown) and `group` (the KV-cache group whose pool holds it, 0: the full-attention one);
# per sequence, its token ids (`tok_seq`, `tok_len`, the concatenated `tokens`) and the `block_size` (one value)
# they were cut at, so the what-if curves can name a block by its contents and re-cut the tokens at other sizes;
# and per sequence its prompt's length (`tok_prompt`, with the token columns): a block past the prompt is written by
# its sequence, never found in a cache at its first read.
# Per sequence also its arrival on the engine clock (`tok_arrival`); per engine step while recording, its start time
# (`step_t`), the tokens it computed (`step_tokens`) and the sequences it ran (`step_seqs`); and `meta`, the engine's knobs and scheduling options as
# UTF-8 JSON bytes: what engine/lab/kv_replay.py reruns the requests with.
OPTIONAL = ("pos", "group", "tok_seq", "tok_len", "tokens", "block_size", "tok_prompt", "tok_arrival", "step_t",
            "step_tokens", "step_seqs", "meta")
MAX_META_BYTES = 1 << 16

# The most rows `AccessTrace.load` accepts. A trace's columns take at most 33 bytes a row (all five at
# their widest), so a file that passes holds at most ~1.65 GB of columns however well it compresses: a
# .npz is a zip, and 2.3 MB of deflated zeros is 2.4 GB of array.
MAX_TRACE_ROWS = 50_000_000
# The largest file `AccessTrace.load` opens (checked by stat before a byte is read): five columns at their
# widest, stored, are 1.65 GB.
MAX_FILE_BYTES = 2 * 2**30

# Per column: the dtype kinds accepted (numpy's dtype.kind letters) and how to say so.
_KINDS = {"t": ("fiu", "numbers (seconds)"), "seq": ("iu", "integers"), "block": ("iu", "integers"),
          "tier": ("iu", "integers"), "hit": ("b", "booleans"), "pos": ("iu", "integers"),
          "group": ("iu", "integers"), "tok_seq": ("iu", "integers"), "tok_len": ("iu", "integers"),
          "tok_prompt": ("iu", "integers"), "tok_arrival": ("fiu", "numbers (seconds)"),
          "step_t": ("fiu", "numbers (seconds)"), "step_tokens": ("iu", "integers"), "step_seqs": ("iu", "integers"), "meta": ("u", "bytes (uint8)"),
          "tokens": ("iu", "integers"), "block_size": ("iu", "integers")}
_READ_CHUNK = 1 << 24  # bytes decompressed per read: the only buffer besides the columns themselves
# The compressions np.savez and np.savez_compressed write, and the most bytes one stored byte can become
# (deflate's limit is 1032; a zip entry's sizes are declared, so this catches an entry that lies about its).
_MAX_EXPANSION = {zipfile.ZIP_STORED: 1, zipfile.ZIP_DEFLATED: 1100}


class TraceFileError(ValueError):
    """A file that is not a usable access trace; the message starts with the file's path."""


def _member(z: zipfile.ZipFile, col: str) -> zipfile.ZipInfo | None:
    for name in (col + ".npy", col):  # np.savez names members "t.npy"; np.load also takes a bare "t"
        try:
            return z.getinfo(name)
        except KeyError:
            pass
    return None


def _header(fp, path: str, col: str, info: zipfile.ZipInfo) -> tuple[int, np.dtype]:
    """Rows and dtype of the column whose .npy member `fp` is, read from its header alone and checked
    against everything the data must satisfy, before any of the data is read."""
    try:
        version = npy_format.read_magic(fp)
        if version == (1, 0):
            shape, _, dtype = npy_format.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, _, dtype = npy_format.read_array_header_2_0(fp)
        else:
            raise ValueError(f"unsupported .npy format version {version[0]}.{version[1]}")
    except ValueError as e:
        raise TraceFileError(f"{path}: column {col!r} is not a readable .npy array ({e})") from None
    if len(shape) != 1:
        what = "0-d (a single value)" if not shape else f"{len(shape)}-d, shape {shape}"
        raise TraceFileError(f"{path}: column {col!r} is {what}; each column must be a 1-d array")
    kinds, expected = _KINDS[col]
    if dtype.kind not in kinds or dtype.fields is not None or dtype.itemsize > 8:
        raise TraceFileError(f"{path}: column {col!r} has dtype {dtype}; expected {expected}")
    rows = shape[0]
    if rows > MAX_TRACE_ROWS:
        raise TraceFileError(f"{path}: column {col!r} declares {rows:,} rows; the limit is {MAX_TRACE_ROWS:,}")
    declared = fp.tell() + rows * dtype.itemsize
    if info.file_size != declared:
        raise TraceFileError(f"{path}: column {col!r} declares {rows:,} rows of {dtype} ({declared:,} bytes with "
                             f"its header) but its zip member holds {info.file_size:,} bytes")
    return rows, dtype


def _read_into(fp, path: str, col: str, rows: int, dtype: np.dtype) -> np.ndarray:
    a = np.empty(rows, dtype=dtype)
    view = memoryview(a.view(np.uint8))
    got = 0
    while got < len(view):
        k = fp.readinto(view[got:got + _READ_CHUNK])
        if not k:
            raise TraceFileError(f"{path}: column {col!r} ends after {got:,} of {len(view):,} bytes of data")
        got += k
    return a


def _first_bad(mask: np.ndarray) -> int | None:
    return int(np.argmax(mask)) if mask.any() else None


def _read(path: str) -> dict[str, np.ndarray]:
    with open_regular(path, MAX_FILE_BYTES, "an access trace") as f, zipfile.ZipFile(f) as z:
        infos = {c: _member(z, c) for c in COLUMNS}
        missing = [c for c, i in infos.items() if i is None]
        if missing:
            names = z.namelist()
            has = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            raise TraceFileError(f"{path}: not a KV Scope access trace: no column {', '.join(map(repr, missing))} "
                                 f"(it holds: {has or 'nothing'})")
        for c, info in infos.items():
            most = _MAX_EXPANSION.get(info.compress_type)
            if most is None:
                raise TraceFileError(f"{path}: column {c!r} uses zip compression method {info.compress_type}; "
                                     f"a trace is stored or deflated (np.savez, np.savez_compressed)")
            if info.file_size > most * info.compress_size + 1024:
                raise TraceFileError(f"{path}: column {c!r}: its zip entry declares {info.file_size:,} bytes from "
                                     f"{info.compress_size:,} stored, more than the compression can give")
        with ExitStack() as stack:
            streams = {c: stack.enter_context(z.open(info)) for c, info in infos.items()}
            heads = {c: _header(streams[c], path, c, infos[c]) for c in COLUMNS}
            if len({rows for rows, _ in heads.values()}) != 1:
                lens = ", ".join(f"{c} {rows:,}" for c, (rows, _) in heads.items())
                raise TraceFileError(f"{path}: columns of different lengths ({lens})")
            cols = {c: _read_into(streams[c], path, c, *heads[c]) for c in COLUMNS}
            rows = len(cols["t"])
            for c in OPTIONAL:
                info = _member(z, c)
                if info is None:
                    continue
                most = _MAX_EXPANSION.get(info.compress_type)
                if most is None or info.file_size > most * info.compress_size + 1024:
                    raise TraceFileError(f"{path}: column {c!r}: unsupported compression or a size it cannot have")
                fp = stack.enter_context(z.open(info))
                n, dt = _header(fp, path, c, info)
                if c == "meta" and n > MAX_META_BYTES:
                    raise TraceFileError(f"{path}: column 'meta' holds {n:,} bytes; the limit is {MAX_META_BYTES:,}")
                if c in ("pos", "group") and n != rows:
                    raise TraceFileError(f"{path}: column {c!r} has {n:,} rows; the trace has {rows:,}")
                cols[c] = _read_into(fp, path, c, n, dt)
    return cols


def _checked(path: str, cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Values checked and columns in the dtypes the lab expects (native byte order)."""
    t = cols["t"].astype(np.float64, copy=False)
    i = _first_bad(~np.isfinite(t))
    if i is not None:
        raise TraceFileError(f"{path}: column 't' has a time that is not a finite number ({t[i]} at row {i:,})")
    block = cols["block"]
    if block.dtype.kind == "u":
        i = _first_bad(block > np.iinfo(np.int64).max)
    else:
        i = _first_bad(block < 0)
    if i is not None:
        raise TraceFileError(f"{path}: column 'block' has block serial {block[i]} at row {i:,}; serials are "
                             f"0 .. {np.iinfo(np.int64).max:,}")
    tier = cols["tier"]
    i = _first_bad((tier != 0) & (tier != 1))
    if i is not None:
        raise TraceFileError(f"{path}: column 'tier' has {tier[i]} at row {i:,}; a tier is 0 (device) or 1 (host)")
    seq = cols["seq"]
    out = dict(t=t, seq=seq.astype(seq.dtype.newbyteorder("="), copy=False),
               block=block.astype(np.int64, copy=False), tier=tier.astype(np.int8, copy=False),
               hit=cols["hit"].view(np.uint8) != 0)  # a bool byte that is neither 0 nor 1 reads as True
    return out | _checked_optional(path, cols)


def _checked_optional(path: str, cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out: dict = {}
    if "pos" in cols:
        out["pos"] = cols["pos"].astype(np.int64).astype(np.int32)  # -1 (unknown) survives from any int dtype
    if "group" in cols:
        g = cols["group"]
        i = _first_bad((g < 0) | (g > 127))
        if i is not None:
            raise TraceFileError(f"{path}: column 'group' has {g[i]} at row {i:,}; a group is 0 .. 127")
        out["group"] = g.astype(np.int8)
    have = [c for c in ("tok_seq", "tok_len", "tokens", "block_size") if c in cols]
    if have and len(have) < 4:
        raise TraceFileError(f"{path}: token columns {', '.join(have)} without the rest "
                             f"(tok_seq, tok_len, tokens and block_size go together)")
    if have:
        ts, tl, tk, bs = cols["tok_seq"], cols["tok_len"], cols["tokens"], cols["block_size"]
        if len(ts) != len(tl):
            raise TraceFileError(f"{path}: tok_seq has {len(ts):,} entries and tok_len {len(tl):,}")
        if len(bs) != 1 or not 1 <= int(bs[0]) <= 65536:
            raise TraceFileError(f"{path}: block_size must be one value from 1 to 65,536")
        if tl.dtype.kind == "i" and (tl < 0).any() or int(tl.sum(dtype=np.uint64)) != len(tk):
            raise TraceFileError(f"{path}: tok_len adds up to {int(tl.sum()):,} tokens but tokens holds {len(tk):,}")
        if "tok_prompt" in cols:
            tp = cols["tok_prompt"]
            if len(tp) != len(ts) or (tp.dtype.kind == "i" and (tp < 0).any()):
                raise TraceFileError(f"{path}: tok_prompt must hold one length >= 0 per entry of tok_seq")
            out["tok_prompt"] = tp.astype(np.int64)
        if "tok_arrival" in cols:
            ta = cols["tok_arrival"].astype(np.float64)
            if len(ta) != len(ts) or not np.isfinite(ta).all():
                raise TraceFileError(f"{path}: tok_arrival must hold one finite time per entry of tok_seq")
            out["tok_arrival"] = ta
        out.update(tok_seq=ts.astype(np.int64), tok_len=tl.astype(np.int64), tokens=tk.astype(np.int64),
                   block_size=int(bs[0]))
    if ("step_t" in cols) != ("step_tokens" in cols):
        raise TraceFileError(f"{path}: step_t and step_tokens go together")
    if "step_t" in cols:
        st, sn = cols["step_t"].astype(np.float64), cols["step_tokens"]
        if len(st) != len(sn) or not np.isfinite(st).all() or (sn.dtype.kind == "i" and (sn < 0).any()):
            raise TraceFileError(f"{path}: step_t and step_tokens must be of one length, finite times and counts >= 0")
        out.update(step_t=st, step_tokens=sn.astype(np.int64))
        if "step_seqs" in cols:
            sq = cols["step_seqs"]
            if len(sq) != len(st) or (sq.dtype.kind == "i" and (sq < 0).any()):
                raise TraceFileError(f"{path}: step_seqs must hold one count >= 0 per step")
            out["step_seqs"] = sq.astype(np.int64)
    if "meta" in cols:
        import json

        try:
            meta = json.loads(cols["meta"].tobytes().decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise TraceFileError(f"{path}: column 'meta' is not UTF-8 JSON ({type(e).__name__})") from None
        if not isinstance(meta, dict):
            raise TraceFileError(f"{path}: column 'meta' must be a JSON object")
        out["meta"] = meta
    return out


@dataclass(frozen=True)
class AccessTrace:
    t: np.ndarray  # float64 seconds (engine clock)
    seq: np.ndarray  # int32 sequence id
    block: np.ndarray  # int64 block serial
    tier: np.ndarray  # int8: where the block was when read (0 device, 1 host)
    hit: np.ndarray  # bool: served from the device tier (a prefetched block counts as a hit)
    pos: np.ndarray | None = None  # int32: the block's index in its sequence (block j holds tokens j·bs ..; -1: not known)
    group: np.ndarray | None = None  # int8: KV-cache group (None: all 0, the full-attention group)
    tok_seq: np.ndarray | None = None  # per recorded sequence: its id,
    tok_len: np.ndarray | None = None  # its number of tokens,
    tok_prompt: np.ndarray | None = None  # (optional) how many of them are its prompt,
    tokens: np.ndarray | None = None  # and its token ids, all sequences' concatenated
    block_size: int | None = None  # the block size the trace's blocks were cut at
    tok_arrival: np.ndarray | None = None  # per recorded sequence: its arrival (engine clock)
    step_t: np.ndarray | None = None  # per engine step while recording: its start (engine clock),
    step_tokens: np.ndarray | None = None  # the tokens it computed (prompt chunks and decodes),
    step_seqs: np.ndarray | None = None  # and the sequences it ran
    meta: dict | None = None  # the engine's knobs and options when recorded ("config", "options", "capacity")

    def __len__(self) -> int:
        return len(self.t)

    def token_lists(self) -> dict[int, np.ndarray]:
        """Each recorded sequence's token ids (prompt and generated, as at the end of the recording)."""
        if self.tokens is None:
            return {}
        ends = np.cumsum(self.tok_len)
        return {int(s): self.tokens[e - n:e] for s, n, e in zip(self.tok_seq, self.tok_len, ends)}

    def save(self, path: str) -> None:
        cols = {c: getattr(self, c) for c in COLUMNS}
        for c in ("pos", "group", "tok_seq", "tok_len", "tokens", "tok_prompt", "tok_arrival", "step_t", "step_tokens",
                  "step_seqs"):
            if getattr(self, c) is not None:
                cols[c] = getattr(self, c)
        if self.meta is not None:
            import json

            cols["meta"] = np.frombuffer(json.dumps(self.meta).encode("utf-8"), dtype=np.uint8)
        if self.block_size is not None:
            cols["block_size"] = np.array([self.block_size], dtype=np.int64)
        np.savez_compressed(path, **cols)

    @staticmethod
    def load(path: str) -> "AccessTrace":
        """Read a trace saved by `save`. Anything else raises TraceFileError (a ValueError) whose message
        starts with `path` and says what is wrong: not a zip, a missing column, a column that is not 1-d,
        of the wrong dtype, longer than MAX_TRACE_ROWS or with a header that disagrees with its data's size,
        columns of different lengths, a time that is not finite, a negative block serial, a tier other than
        0 or 1; a path that is not a regular file (a FIFO, a device, a directory) or is larger than
        MAX_FILE_BYTES, before a byte is read. Every column's .npy header is checked before any data is read, so
        a file can make this allocate no more than its headers declare (at most MAX_TRACE_ROWS rows); never
        unpickles."""
        try:
            cols = _read(path)
        except TraceFileError:
            raise
        except UserFileError as e:  # missing, not a regular file (a FIFO, a device, a directory), too large
            raise TraceFileError(str(e)) from None
        except zipfile.BadZipFile as e:
            if os.path.isfile(path) and os.path.getsize(path) == 0:
                raise TraceFileError(f"{path}: the file is empty") from None
            if "not a zip file" in str(e):
                raise TraceFileError(f"{path}: not a KV Scope access trace: not an .npz (zip) file") from None
            raise TraceFileError(f"{path}: damaged .npz file ({e})") from None
        except (zlib.error, EOFError, NotImplementedError, RuntimeError) as e:
            # truncated or corrupt compressed data, an unsupported compression method, an encrypted member
            raise TraceFileError(f"{path}: damaged or unsupported .npz file ({e})") from None
        except OSError as e:
            raise TraceFileError(f"{path}: cannot read the file ({e.strerror or e})") from None
        return AccessTrace(**_checked(path, cols))


class TraceRecorder:
    """Collects reads in chunks (one per step and sequence) and concatenates them once at the end.

    A chunk is a sequence's block table in order, so a row's index in its chunk is the block's position.
    seq_of (optional): sequence id -> an object whose `.tokens` is the sequence's token list; the recorder keeps
    it from the sequence's first read and saves its tokens as they are when the trace is taken (a context shift
    meanwhile leaves the shifted list), with `block_size`, so a block can be named by its contents.
    """

    def __init__(self, seq_of=None, block_size: int | None = None, group: int = 0):
        self._chunks: list[tuple[float, int, np.ndarray, np.ndarray, np.ndarray, int, int]] = []
        self.rows = 0
        self._seq_of = seq_of
        self._seqs: dict = {}
        self.block_size = block_size
        self.group = group
        self._steps: list[tuple[float, int, int]] = []
        self.meta: dict | None = None  # set by the engine: its knobs and options (engine/lab/kv_replay.py)

    def step(self, t: float, tokens: int, seqs: int) -> None:
        """An engine step starting at `t` computes `tokens` tokens (prompt chunks and decodes) of `seqs` sequences."""
        self._steps.append((t, int(tokens), int(seqs)))

    @property
    def steps(self) -> int:
        """Steps recorded so far."""
        return len(self._steps)

    def step_tokens(self, since: int) -> int:
        """Tokens computed by the steps recorded from index `since` on."""
        return sum(s[1] for s in self._steps[since:])

    def step_seqs(self, since: int) -> int:
        """Sequences run by the steps recorded from index `since` on."""
        return sum(s[2] for s in self._steps[since:])

    def add(self, t: float, seq: int, blocks: np.ndarray, tiers: np.ndarray, hits: np.ndarray,
            group: int | None = None, first: int = 0) -> None:
        """One read of a sequence's table: `blocks` (serials) in order, the first being the sequence's block
        `first` (a sliding-window group's table starts at its first visible block, Sequence.base / GroupTable.base)."""
        self._chunks.append((t, seq, blocks.copy(), tiers.astype(np.int8), hits.astype(bool),
                             self.group if group is None else group, int(first)))
        self.rows += len(blocks)
        if self._seq_of is not None and seq not in self._seqs:
            self._seqs[seq] = self._seq_of(seq)

    def for_group(self, group: int) -> "_GroupRecorder":
        """A recorder for KV-cache group `group`'s pool (engine/kv/cache.py): its rows land in this trace,
        tagged with the group (block serials are per pool, so the curves take one group at a time)."""
        return _GroupRecorder(self, group)

    def trace(self) -> AccessTrace:
        if not self._chunks:
            z = np.zeros(0)
            return AccessTrace(z, z.astype(np.int32), z.astype(np.int64), z.astype(np.int8), z.astype(bool))
        lens = [len(c[2]) for c in self._chunks]
        toks = {s: np.asarray(o.tokens, dtype=np.int64) for s, o in self._seqs.items() if o is not None}
        extra: dict = {}
        if toks and self.block_size:
            extra = dict(tok_seq=np.array(list(toks), dtype=np.int64),
                         tok_len=np.array([len(v) for v in toks.values()], dtype=np.int64),
                         tokens=np.concatenate(list(toks.values())), block_size=int(self.block_size))
            prompt = [getattr(self._seqs[s], "prompt_len", None) for s in toks]
            if all(isinstance(n, int) for n in prompt):
                extra["tok_prompt"] = np.array(prompt, dtype=np.int64)
            arrival = [getattr(self._seqs[s], "arrival", None) for s in toks]
            if all(isinstance(a, (int, float)) for a in arrival):
                extra["tok_arrival"] = np.array(arrival, dtype=np.float64)
        if self._steps:
            extra["step_t"] = np.array([s[0] for s in self._steps], dtype=np.float64)
            extra["step_tokens"] = np.array([s[1] for s in self._steps], dtype=np.int64)
            extra["step_seqs"] = np.array([s[2] for s in self._steps], dtype=np.int64)
        if self.meta is not None:
            extra["meta"] = self.meta
        return AccessTrace(
            t=np.repeat([c[0] for c in self._chunks], lens).astype(np.float64),
            seq=np.repeat([c[1] for c in self._chunks], lens).astype(np.int32),
            block=np.concatenate([c[2] for c in self._chunks]).astype(np.int64),
            tier=np.concatenate([c[3] for c in self._chunks]),
            hit=np.concatenate([c[4] for c in self._chunks]),
            pos=np.concatenate([np.arange(c[6], c[6] + n, dtype=np.int32) for c, n in zip(self._chunks, lens)]),
            group=np.repeat([c[5] for c in self._chunks], lens).astype(np.int8),
            **extra,
        )


class _GroupRecorder:
    """One KV-cache group's door into a TraceRecorder: `add` tags the rows; `trace` and `rows` are the whole's."""

    def __init__(self, whole: TraceRecorder, group: int):
        self.whole, self.group = whole, group

    def add(self, t: float, seq: int, blocks: np.ndarray, tiers: np.ndarray, hits: np.ndarray, first: int = 0) -> None:
        self.whole.add(t, seq, blocks, tiers, hits, self.group, first)

    @property
    def rows(self) -> int:
        return self.whole.rows

    def trace(self) -> AccessTrace:
        return self.whole.trace()
