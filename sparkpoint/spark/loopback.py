"""Proving that what listens on a loopback port is the process we started, and a Spark Connect
channel that sends its token only there (DESIGN rule 17: check the peer before a secret leaves).

A port on 127.0.0.1 is no proof of whose server answers: any local user may bind a port before
our JVM does, or listen on `[::1]` at the same number, where gRPC's resolver of `localhost` tries
first. So the warm local Spark is reached

* at the exact address it bound (`127.0.0.1:P`, never the name `localhost`), and
* only once the kernel says the listening socket at that address is held by the JVM we started
  (`/proc/net/tcp` names the socket's inode, `/proc/<pid>/fd` shows the JVM holds it); while that
  JVM lives it holds the address, and no other process can listen there;
* every call first checks that the JVM still lives (a JVM that died frees the address for
  anyone): the token is attached to a call only after that check.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable
from typing import Any

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column
_LOOPBACK = "127.0.0.1"


def proc_available() -> bool:
    """Whether this system shows sockets and their owners under /proc (Linux does)."""
    return os.path.exists("/proc/net/tcp") and os.path.isdir("/proc/self/fd")


def _hex_addresses(host: str, port: int) -> dict[str, str]:
    """An IPv4 address and port as /proc/net/tcp writes them, and as /proc/net/tcp6 writes the
    same address mapped into IPv6 (where a JVM's sockets appear): each 32-bit word of the address
    as the machine's byte order prints it, the port big-endian."""
    mapped = socket.inet_pton(socket.AF_INET6, f"::ffff:{host}")
    word = struct.unpack("=I", socket.inet_aton(host))[0]
    return {"/proc/net/tcp": f"{word:08X}:{port:04X}",
            "/proc/net/tcp6": "".join(f"{w:08X}" for w in struct.unpack("=4I", mapped)) + f":{port:04X}"}


def listening_inodes(port: int, host: str = _LOOPBACK) -> set[int]:
    """The inodes of the sockets listening on exactly `host`:`port` (IPv4, or IPv4 mapped into
    an IPv6 socket as Java binds it)."""
    inodes: set[int] = set()
    for table, wanted in _hex_addresses(host, port).items():
        try:
            with open(table) as f:
                next(f, None)  # the header
                for line in f:
                    fields = line.split()
                    if len(fields) > 9 and fields[1] == wanted and fields[3] == LISTEN:
                        inodes.add(int(fields[9]))
        except OSError:
            continue
    return inodes


def holds_socket(pid: int, inodes: set[int]) -> bool:
    """Whether process `pid` has one of the sockets `inodes` open (readable for our own processes)."""
    if not inodes:
        return False
    names = {f"socket:[{inode}]" for inode in inodes}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in names:
                return True
        except OSError:
            continue
    return False


def holding_inodes(pid: int, port: int, host: str = _LOOPBACK) -> set[int]:
    """The sockets listening on `host`:`port` that process `pid` holds (empty: not it)."""
    return {inode for inode in listening_inodes(port, host) if holds_socket(pid, {inode})}


def listens_on(pid: int, port: int, host: str = _LOOPBACK) -> bool:
    """Whether process `pid` is what listens on `host`:`port`."""
    return holds_socket(pid, listening_inodes(port, host))


def verified_channel_builder(url: str, still_ours: Callable[[], bool]) -> Any:
    """A Spark Connect channel builder for `url` (`sc://127.0.0.1:P/;token=...`) that connects to
    exactly that address with gRPC's local-connection credentials, and checks `still_ours()`
    before each call, so the token goes out only while the proven server holds the address."""
    import grpc
    from pyspark.sql.connect.client.core import DefaultChannelBuilder

    kinds = (grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
             grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor)

    class _PeerCheck(*kinds):  # type: ignore[misc]
        def _checked(self, continuation: Any, details: Any, request: Any) -> Any:
            if not still_ours():
                raise ConnectionError(f"the Spark server at {_shown(url)} is gone; nothing was sent to its address")
            return continuation(details, request)

        intercept_unary_unary = intercept_unary_stream = _checked
        intercept_stream_unary = intercept_stream_stream = _checked

    class _VerifiedBuilder(DefaultChannelBuilder):
        def toChannel(self) -> Any:  # noqa: N802 - PySpark's name
            credentials = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
            if self.token is not None:
                credentials = grpc.composite_channel_credentials(
                    credentials, grpc.access_token_call_credentials(self.token))
            channel = grpc.secure_channel(self.endpoint, credentials, options=self._effective_channel_options())
            return grpc.intercept_channel(channel, _PeerCheck(), *self._interceptors)

    return _VerifiedBuilder(url)


def _shown(url: str) -> str:
    return "sc://" + url.removeprefix("sc://").split("/", 1)[0].split(";", 1)[0]
