"""A counting HTTP proxy in front of the tests' moto S3 server: what the server was asked, counted
apart from sparkpoint's own ledger (its own classification of requests, from the wire).

`CountingProxy(upstream)` listens on 127.0.0.1 (a free port); point s3fs's `endpoint_url` at
`proxy.url`. `proxy.take()` returns what was counted since the last take: requests by S3 class
(PUT, GET, LIST, HEAD, DELETE, COPY), split into those under `input_prefix` (bucket/key) and the
rest, with the bytes of request and response bodies.
"""

from __future__ import annotations

import http.client
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "expect"}


def s3_class(method: str, path: str, query: str, headers: Any) -> str:
    """How S3 bills a request (DeleteObjects is a POST; a multipart upload's parts are PUTs)."""
    if method == "PUT":
        return "COPY" if headers.get("x-amz-copy-source") else "PUT"
    if method == "POST":
        return "DELETE" if "delete" in parse_qs(query, keep_blank_values=True) else "PUT"
    if method == "GET":
        key = path.strip("/").partition("/")[2]
        return "LIST" if not key else "GET"
    return method


class CountingProxy:
    def __init__(self, upstream: str, input_prefix: str = ""):
        target = urlsplit(upstream)
        self.host, self.port = target.hostname or "127.0.0.1", target.port or 80
        self.input_prefix = input_prefix.strip("/")
        self._lock = threading.Lock()
        self._reset()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                body = self._body()
                conn = http.client.HTTPConnection(proxy.host, proxy.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                conn.close()
                proxy._count(self.command, self.path, self.headers, len(body),
                             0 if self.command == "HEAD" else len(data))
                self.send_response(response.status, response.reason)
                for k, v in response.getheaders():
                    if k.lower() not in _HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                length = response.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length or "0")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while (size := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                        out += self.rfile.read(size)
                        self.rfile.readline()
                    self.rfile.readline()
                    return out
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _reset(self) -> None:
        self.requests: Counter[str] = Counter()
        self.input_requests: Counter[str] = Counter()
        self.bytes_up = self.bytes_down = self.input_bytes = 0

    def _count(self, method: str, raw_path: str, headers: Any, up: int, down: int) -> None:
        split = urlsplit(raw_path)
        path = unquote(split.path).strip("/")
        prefix = parse_qs(split.query).get("prefix")
        where = f"{path}/{prefix[0]}" if prefix else path
        is_input = bool(self.input_prefix) and (where == self.input_prefix
                                                or where.startswith(self.input_prefix + "/"))
        op = s3_class(method, split.path, split.query, headers)
        with self._lock:
            if is_input:
                self.input_requests[op] += 1
                self.input_bytes += down
            else:
                self.requests[op] += 1
                self.bytes_up += up
                self.bytes_down += down

    def take(self) -> dict[str, Any]:
        """What was counted since the last take, in the ledger's JSON shape."""
        ops = ("PUT", "GET", "LIST", "HEAD", "DELETE", "COPY")
        with self._lock:
            out = {"requests": {op: self.requests[op] for op in ops}, "bytes_up": self.bytes_up,
                   "bytes_down": self.bytes_down,
                   "input": {"requests": {op: self.input_requests[op] for op in ops}, "bytes": self.input_bytes}}
            self._reset()
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
