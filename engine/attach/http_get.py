"""One bounded HTTP GET, for /metrics: a deadline on the whole exchange, a cap on the body, no redirects.

urllib's timeout is per read, so a server that sends a byte a second holds a scrape forever, and it follows
a redirect to any host and port. Here the request is HTTP/1.0 (the server closes the connection to end the
body, and sends no chunked encoding, though that is read too), every read waits at most what is left of the
deadline, a body longer than the cap is refused (as soon as a Content-Length says so), and any status but 200
is an error that says what it was (a 3xx with where it pointed). GET only: attach never writes to a server.
"""

from __future__ import annotations

import socket
import ssl
import time
import urllib.parse

MAX_HEADER = 64 << 10


class FetchError(OSError):
    """The GET did not give a usable body; the message says why."""


def _recv(sock: socket.socket, end: float, n: int) -> bytes:
    """One read of at most n bytes (b"" at the end of the stream); FetchError past the deadline."""
    left = end - time.monotonic()
    if left <= 0:
        raise FetchError("no complete answer within the deadline")
    sock.settimeout(left)
    try:
        return sock.recv(n)
    except (socket.timeout, TimeoutError):
        raise FetchError("no complete answer within the deadline") from None


def _dechunk(body: bytes) -> bytes:
    out, i = bytearray(), 0
    while True:
        j = body.find(b"\r\n", i)
        if j < 0:
            raise FetchError("a chunked body that ends early")
        try:
            n = int(body[i:j].split(b";")[0], 16)
        except ValueError:
            raise FetchError("a chunked body with a bad chunk size") from None
        if n == 0:
            return bytes(out)
        out += body[j + 2: j + 2 + n]
        i = j + 2 + n + 2


def get(url: str, deadline_s: float = 3.0, max_body: int = 8 << 20, accept: str = "text/plain") -> bytes:
    """The body of a 200 answer to GET url, within deadline_s all told; FetchError (an OSError) otherwise."""
    end = time.monotonic() + deadline_s
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise FetchError(f"{url!r}: not an http(s) URL")
    port = u.port or (443 if u.scheme == "https" else 80)
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    host_hdr = u.netloc.rsplit("@", 1)[-1]
    try:
        sock = socket.create_connection((u.hostname, port), timeout=max(0.01, end - time.monotonic()))
    except (socket.timeout, TimeoutError):
        raise FetchError("no connection within the deadline") from None
    try:
        if u.scheme == "https":
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=u.hostname)
        sock.settimeout(max(0.01, end - time.monotonic()))
        sock.sendall(f"GET {path} HTTP/1.0\r\nHost: {host_hdr}\r\nAccept: {accept}\r\nUser-Agent: kvscope-attach"
                     f"\r\nConnection: close\r\n\r\n".encode("latin-1"))
        buf = bytearray()
        while b"\r\n\r\n" not in buf:  # the head first, so a Content-Length over the cap is refused unread
            if len(buf) > MAX_HEADER:
                raise FetchError(f"an HTTP header over {MAX_HEADER >> 10} KB")
            chunk = _recv(sock, end, 1 << 16)
            if not chunk:
                raise FetchError("the server closed the connection before answering" if not buf else
                                 "the server closed the connection in the middle of the header")
            buf += chunk
        head, _, rest = bytes(buf).partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            raise FetchError(f"not an HTTP answer ({lines[0][:60]!r})")
        status, reason = int(parts[1]), parts[2] if len(parts) > 2 else ""
        hdrs = {}
        for ln in lines[1:]:
            k, _, v = ln.partition(":")
            hdrs[k.strip().lower()] = v.strip()
        if 300 <= status < 400:
            raise FetchError(f"HTTP {status} {reason}: redirects are not followed (to "
                             f"{hdrs.get('location', '?')[:200]}); give the URL it points to")
        if status != 200:
            raise FetchError(f"HTTP {status} {reason}")
        length = hdrs.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body:
            raise FetchError(f"a {int(length):,}-byte body, over the {max_body:,}-byte limit")
        body = bytearray(rest)
        chunked = "chunked" in hdrs.get("transfer-encoding", "").lower()
        cap = max_body + (64 << 10 if chunked else 0)  # chunk sizes and line ends on top of the data
        want = int(length) if length is not None and length.isdigit() and not chunked else None
        # Up to the Content-Length where there is one (a server may keep the connection open anyway), else EOF.
        while len(body) <= cap and (want is None or len(body) < want):
            chunk = _recv(sock, end, 1 << 16)
            if not chunk:
                break
            body += chunk
        if len(body) > cap:
            raise FetchError(f"a body over the {max_body:,}-byte limit")
        if want is not None and len(body) < want:
            raise FetchError(f"the body ended after {len(body):,} of {want:,} bytes")
        out = _dechunk(bytes(body)) if chunked else bytes(body[:want] if want is not None else body)
        if len(out) > max_body:
            raise FetchError(f"a body over the {max_body:,}-byte limit")
        return out
    except (socket.timeout, TimeoutError):
        raise FetchError("no complete answer within the deadline") from None
    finally:
        sock.close()
