"""A file the user named (a trace, a prompt file, an access trace): opened only if it is a regular file, its
size capped by stat before a byte is read, and no read going past that cap even if the file grows meanwhile.

A FIFO would block in open until a writer came, and a device such as /dev/zero never ends; both are refused,
as are directories and files over the cap, each with one line naming the file (UserFileError, a ValueError).
The open itself never blocks: the path is checked by stat first, opened with O_NONBLOCK, and checked again on
the open descriptor (the path may have been swapped in between).

JSON-lines files are read a line at a time (`json_lines`), so memory is bounded by the longest line allowed,
not by the file. A line's own problem (too long, not UTF-8, not JSON, nested too deeply, an integer too long
to convert, a lone surrogate that no tokenizer can take) comes back as that line's `problem`, with the reading
going on, so a caller can skip the line or stop there. Torch-free.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from typing import BinaryIO, Iterator

MAX_JSONL_BYTES = 256 * 2**20  # a JSONL trace or prompt file (larger ones are refused before they are read)
MAX_LINE_BYTES = 16 * 2**20  # one line of it: a 128k-token prompt as text or token ids is under 1 MB
_DRAIN_CHUNK = 1 << 20  # bytes read at a time past a line that is too long, to find where it ends


class UserFileError(ValueError):
    """A file that cannot be read as asked; the one-line message starts with the path."""


def size_text(n: int) -> str:
    """A size for a message: whole MB as such, else the bytes (a file one byte over a cap must not read as
    the cap)."""
    if n >= 2**20 and n % 2**20 == 0:
        return f"{n // 2**20:,} MB"
    return f"{n:,} bytes" + (f" ({n / 2**20:,.1f} MB)" if n >= 2**20 else "")


def _kind(mode: int) -> str | None:
    """What a file that is not a regular file is, for the message; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file"


def _check(path: str, st: os.stat_result, max_bytes: int, what: str) -> None:
    kind = _kind(st.st_mode)
    if kind is not None:
        raise UserFileError(f"{path}: is {kind}, not a regular file ({what} must be one)")
    if st.st_size > max_bytes:
        raise UserFileError(f"{path}: the file is {size_text(st.st_size)}, more than the {size_text(max_bytes)} "
                            f"{what} may be")


def open_regular(path: str | os.PathLike[str], max_bytes: int, what: str = "a file") -> BinaryIO:
    """`path` opened for binary reading if it is a regular file of at most `max_bytes`; else UserFileError.
    `what` names the kind of file with its article ("a trace"), for the messages.
    The caller must still read at most `max_bytes` (the file may grow after the check): see `read_bytes`."""
    path = os.fspath(path)
    try:
        _check(path, os.stat(path), max_bytes, what)  # before open: opening a FIFO or a device can block
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise UserFileError(f"{path}: {e.strerror or e}") from None
    try:
        _check(path, os.fstat(fd), max_bytes, what)  # the file actually opened (a path can be swapped)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | os.PathLike[str], max_bytes: int, what: str = "a file") -> bytes:
    """The whole file, if it is a regular file of at most `max_bytes` (never more than that is read)."""
    with open_regular(path, max_bytes, what) as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError as e:
            raise UserFileError(f"{os.fspath(path)}: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise UserFileError(f"{os.fspath(path)}: the file grew past the {size_text(max_bytes)} {what} may be")
    return data


# -- JSON lines ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Line:
    """One non-blank line of a JSONL file: its number (from 1), its JSON value, or what is wrong with it."""

    number: int
    value: object = None
    problem: str | None = None


def json_lines(path: str | os.PathLike[str], what: str, max_bytes: int = MAX_JSONL_BYTES,
               max_line: int = MAX_LINE_BYTES) -> Iterator[Line]:
    """Every non-blank line of a JSONL file, parsed, read lazily: at most `max_line` bytes are held at once and
    at most `max_bytes` read in all. The file's own problems (not a regular file, too large, grown past the cap,
    a read error) raise UserFileError; a line's own come back as its `problem` and the reading goes on."""
    path = os.fspath(path)
    with open_regular(path, max_bytes, what) as f:
        total = 0
        number = 0
        while True:
            try:
                raw = f.readline(max_line + 1)
            except OSError as e:
                raise UserFileError(f"{path}: {e.strerror or e}") from None
            if not raw:
                return
            number += 1
            total += len(raw)
            problem = None
            if len(raw) > max_line and not raw.endswith(b"\n"):
                total += _drain_line(f)
                problem = f"the line is longer than the {size_text(max_line)} a line may be"
            if total > max_bytes:
                raise UserFileError(f"{path}: the file grew past the {size_text(max_bytes)} {what} may be")
            if problem is not None:
                yield Line(number, problem=problem)
                continue
            if raw.isspace():
                continue
            yield _parse(number, raw)


def _drain_line(f: BinaryIO) -> int:
    """Read past the rest of an overlong line, a chunk at a time; the bytes consumed."""
    n = 0
    while True:
        chunk = f.readline(_DRAIN_CHUNK)
        n += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return n


def _parse(number: int, raw: bytes) -> Line:
    try:
        text = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a byte-order mark is allowed at the start
    except UnicodeDecodeError as e:
        return Line(number, problem=f"not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line)")
    text = text.rstrip("\r\n")  # so that a column counts from the line's start, on this line
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return Line(number, problem=f"not valid JSON ({e.msg}, column {e.colno})")
    except RecursionError:
        return Line(number, problem="not readable JSON (nested too deeply)")
    except ValueError as e:  # an integer literal with more digits than Python converts (4,300 by default)
        msg = str(e).split(":")[0] if "integer string conversion" in str(e) else str(e)[:80]
        return Line(number, problem=f"not readable JSON ({msg})")
    if "\\u" in text:  # a lone surrogate can only come from a \uD800-style escape (UTF-8 cannot carry one)
        where = lone_surrogate(value)
        if where is not None:
            return Line(number, problem=where)
    return Line(number, value=value)


def surrogate_problem(s: str) -> str | None:
    """"a lone surrogate (\\ud800 at character 4), which is not a character" if `s` holds one (no tokenizer,
    nor stderr, can take it); else None."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"a lone surrogate (\\u{ord(s[e.start]):04x} at character {e.start + 1}), which is not a character"
    return None


def lone_surrogate(value: object) -> str | None:
    """What is wrong if a string (or key) anywhere in a JSON value holds a lone UTF-16 surrogate; else None.
    Walks without recursion."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            problem = surrogate_problem(v)
            if problem is not None:
                return f"a string holds {problem}"
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(x for x in v if isinstance(x, (str, list, dict)))
    return None
