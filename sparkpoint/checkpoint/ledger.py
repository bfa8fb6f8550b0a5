"""The request and byte ledger: every storage request a checkpoint makes, by operation, with the
bytes sent and received, input reads apart; and what they cost by a price table.

Object-store bills are counted in requests (PUT/COPY/POST/LIST per thousand, GET/HEAD per
thousand, DELETE free) and bytes. What is counted is what went on the wire, where it can be seen:

* on S3 (s3fs), every HTTP request botocore sends, retries included, from its event hooks
  (`before-send`, `response-received`): the count the server itself makes;
* on any other filesystem (file://, memory://, a wrapper), every operation at the storage seam
  (`CheckpointStorage`, the input reader), as the S3 request it would be.

Counts go to one tally per process (`count`, `drain`): a Spark task drains what it counted into
its result row, and the driver adds the task ledgers to its own drain. Requests to paths under
an input root (`mark_input`) count as input reads, apart from checkpoint traffic.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

OPERATIONS = ("PUT", "GET", "LIST", "HEAD", "DELETE", "COPY")
CHECKPOINT, INPUT = "checkpoint", "input"


def _zero() -> dict[str, int]:
    return dict.fromkeys(OPERATIONS, 0)


def _requests_from_json(raw: Any, where: str) -> dict[str, int]:
    if not isinstance(raw, Mapping) or not all(
            isinstance(raw.get(op, 0), int) and not isinstance(raw.get(op, 0), bool) and raw.get(op, 0) >= 0
            for op in OPERATIONS) or set(raw) - set(OPERATIONS):
        raise ValueError(f"{where} must map {', '.join(OPERATIONS)} to counts, got {str(raw)[:200]!r}")
    return {op: int(raw.get(op, 0)) for op in OPERATIONS}


def _count_from_json(raw: Any, where: str) -> int:
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 0:
        raise ValueError(f"{where} must be a count of bytes, got {str(raw)[:80]!r}")
    return raw


@dataclass(frozen=True)
class RequestLedger:
    """Requests by operation (OPERATIONS) and bytes up and down of checkpoint traffic, and the
    requests and bytes of input reads apart."""

    requests: Mapping[str, int] = field(default_factory=_zero)
    bytes_up: int = 0
    bytes_down: int = 0
    input_requests: Mapping[str, int] = field(default_factory=_zero)
    input_bytes: int = 0

    def __add__(self, other: RequestLedger) -> RequestLedger:
        return RequestLedger(
            {op: self.requests.get(op, 0) + other.requests.get(op, 0) for op in OPERATIONS},
            self.bytes_up + other.bytes_up, self.bytes_down + other.bytes_down,
            {op: self.input_requests.get(op, 0) + other.input_requests.get(op, 0) for op in OPERATIONS},
            self.input_bytes + other.input_bytes,
        )

    @property
    def total(self) -> int:
        """Checkpoint requests of every operation."""
        return sum(self.requests.values())

    def to_json(self) -> dict[str, Any]:
        """The `_metadata` `stats` fields: `requests`, `bytes_up`, `bytes_down`, `input`."""
        return {"requests": {op: self.requests.get(op, 0) for op in OPERATIONS},
                "bytes_up": self.bytes_up, "bytes_down": self.bytes_down,
                "input": {"requests": {op: self.input_requests.get(op, 0) for op in OPERATIONS},
                          "bytes": self.input_bytes}}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], where: str = "stats") -> RequestLedger:
        """The fields `to_json` writes, strictly (ValueError names the first wrong one)."""
        inp = raw.get("input", {"requests": {}, "bytes": 0})
        if not isinstance(inp, Mapping):
            raise ValueError(f"{where}.input must be an object with requests and bytes, got {str(inp)[:200]!r}")
        return cls(_requests_from_json(raw.get("requests", {}), f"{where}.requests"),
                   _count_from_json(raw.get("bytes_up", 0), f"{where}.bytes_up"),
                   _count_from_json(raw.get("bytes_down", 0), f"{where}.bytes_down"),
                   _requests_from_json(inp.get("requests", {}), f"{where}.input.requests"),
                   _count_from_json(inp.get("bytes", 0), f"{where}.input.bytes"))

    def line(self) -> str:
        """`requests=PUT:12,GET:3,LIST:2 up=1200B down=40B` (operations with none left out)."""
        counts = ",".join(f"{op}:{n}" for op, n in self.requests.items() if n) or "0"
        return f"requests={counts} up={self.bytes_up}B down={self.bytes_down}B"


@dataclass(frozen=True)
class Prices:
    """What requests and bytes cost, in USD: per 1,000 requests of each operation, per GB sent
    (in) and received (out). The default is S3 Standard's public price list for us-east-1 as of
    2026-11-28 (aws.amazon.com/s3/pricing): PUT, COPY, POST, LIST $0.005 per 1,000; GET and the
    other reads $0.0004 per 1,000; DELETE free; data in free; data out to the internet $0.09 per
    GB (to EC2 in the same region it is free: set `out_per_gb` to 0 for that)."""

    per_thousand: Mapping[str, float] = field(default_factory=lambda: {
        "PUT": 0.005, "COPY": 0.005, "LIST": 0.005, "GET": 0.0004, "HEAD": 0.0004, "DELETE": 0.0})
    in_per_gb: float = 0.0
    out_per_gb: float = 0.09

    @classmethod
    def parse(cls, text: str) -> Prices:
        """`PUT=0.005,GET=0.0004,...,in_per_gb=0,out_per_gb=0.09`: the operations and rates given
        replace the defaults. ValueError names what is wrong."""
        base = cls()
        per = dict(base.per_thousand)
        rates = {"in_per_gb": base.in_per_gb, "out_per_gb": base.out_per_gb}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.partition("=")
            name = name.strip()
            try:
                price = float(value)
            except ValueError:
                price = -1.0
            if not sep or price < 0 or price != price:
                raise ValueError(f"price {item!r} is not NAME=USD (a number >= 0), e.g. PUT=0.005")
            if name.upper() in OPERATIONS:
                per[name.upper()] = price
            elif name in rates:
                rates[name] = price
            else:
                raise ValueError(f"price {item!r}: {name!r} is none of {', '.join(OPERATIONS)}, in_per_gb, out_per_gb")
        return cls(per, rates["in_per_gb"], rates["out_per_gb"])

    def cost(self, ledger: RequestLedger) -> float:
        """USD for `ledger`'s requests and bytes, input reads included, rounded to 1e-6."""
        usd = sum((ledger.requests.get(op, 0) + ledger.input_requests.get(op, 0)) * self.per_thousand.get(op, 0.0)
                  for op in OPERATIONS) / 1000
        usd += ledger.bytes_up / 1e9 * self.in_per_gb
        usd += (ledger.bytes_down + ledger.input_bytes) / 1e9 * self.out_per_gb
        return round(usd, 6)


DEFAULT_PRICES = "PUT=0.005,COPY=0.005,LIST=0.005,GET=0.0004,HEAD=0.0004,DELETE=0,in_per_gb=0,out_per_gb=0.09"


class _Tally:
    """This process's counts since the last `drain`, from any thread (s3fs's event loop included)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}
        self._bytes: dict[str, int] = {}

    def add(self, channel: str, op: str, up: int, down: int) -> None:
        with self._lock:
            self._counts[(channel, op)] = self._counts.get((channel, op), 0) + 1
            if channel == INPUT:
                self._bytes["input"] = self._bytes.get("input", 0) + down
            else:
                self._bytes["up"] = self._bytes.get("up", 0) + up
                self._bytes["down"] = self._bytes.get("down", 0) + down

    def add_bytes(self, channel: str, down: int) -> None:
        with self._lock:
            key = "input" if channel == INPUT else "down"
            self._bytes[key] = self._bytes.get(key, 0) + down

    def drain(self) -> RequestLedger:
        with self._lock:
            counts, sizes = self._counts, self._bytes
            self._counts, self._bytes = {}, {}
        return RequestLedger(
            {op: counts.get((CHECKPOINT, op), 0) for op in OPERATIONS}, sizes.get("up", 0), sizes.get("down", 0),
            {op: counts.get((INPUT, op), 0) for op in OPERATIONS}, sizes.get("input", 0))


_TALLY = _Tally()
# path -> channel, replaced whole, never changed in place: read from any thread
_ROOTS: Mapping[str, str] = {}
_HOOKED = "sparkpoint-ledger"


def count(op: str, *, up: int = 0, down: int = 0, channel: str = CHECKPOINT) -> None:
    """One request of operation `op` (OPERATIONS) made at the storage seam."""
    _TALLY.add(channel, op, up, down)


def drain() -> RequestLedger:
    """What this process counted since the last drain; the tally starts again from zero."""
    return _TALLY.drain()


def mark_input(path: str) -> None:
    """Requests for `path` (a bucket/key prefix, as the filesystem names it) and below are input
    reads, unless a checkpoint root below it holds them (`mark_checkpoints`)."""
    _mark(path, INPUT)


def mark_checkpoints(path: str) -> None:
    """Requests for `path` and below are checkpoint traffic, whatever input root holds it."""
    _mark(path, CHECKPOINT)


def _mark(path: str, channel: str) -> None:
    global _ROOTS
    with _TALLY._lock:
        if _ROOTS.get(path.strip("/")) != channel:
            _ROOTS = {**_ROOTS, path.strip("/"): channel}


def channel_of(path: str) -> str:
    """The channel of the longest marked root `path` is under (CHECKPOINT when none)."""
    path, roots = path.strip("/"), _ROOTS
    under = [r for r in roots if path == r or path.startswith(r + "/") or not r]
    return roots[max(under, key=len)] if under else CHECKPOINT


def counts_requests(fs: Any) -> bool:
    """True when `fs`'s requests are counted on the wire (`watch` hooked its client)."""
    return bool(getattr(fs, "_sparkpoint_ledger", False))


def watch(fs: Any) -> bool:
    """Count every HTTP request of `fs` (s3fs) from botocore's event hooks, once per filesystem;
    True when its requests are counted so (the seam then counts nothing for it)."""
    if counts_requests(fs):
        return True
    if type(fs).__module__.partition(".")[0] != "s3fs":
        return False
    try:
        fs.connect()
        emitters = [fs.s3.meta.events, getattr(fs.session, "_session", fs.session)]
    except Exception:  # noqa: BLE001  no client yet (no credentials): counted at the seam instead
        return False
    for emitter in emitters:
        register = getattr(emitter, "register", None)
        if register is not None:
            register("request-created.s3", _created, unique_id=f"{_HOOKED}-created")
            register("before-send.s3", _sent, unique_id=f"{_HOOKED}-send")
            register("response-received.s3", _received, unique_id=f"{_HOOKED}-received")
    fs._sparkpoint_ledger = True
    return True


_COPY_HEADER = "x-amz-copy-source"


def operation_of(method: str, url: str, headers: Mapping[str, str]) -> str:
    """The S3 request class of an HTTP request: what a bill and the server count it as."""
    split = urlsplit(url)
    method = method.upper()
    if method == "PUT":
        return "COPY" if any(k.lower() == _COPY_HEADER for k in headers) else "PUT"
    if method == "POST":
        return "DELETE" if "delete" in split.query.split("&") or "delete=" in split.query else "PUT"
    if method == "GET":
        key = split.path.strip("/").partition("/")[2]
        return "LIST" if not key or "list-type=" in split.query else "GET"
    return method if method in OPERATIONS else "GET"


def _path_of(url: str) -> str:
    """The bucket and key a request is for; for a listing, the bucket and the prefix it lists."""
    split = urlsplit(url)
    path = unquote(split.path)
    prefix = parse_qs(split.query).get("prefix")
    return f"{path.rstrip('/')}/{prefix[0]}" if prefix else path


def _created(request: Any, **_: Any) -> None:
    """Where the response's bytes go (`_received` sees the request's context, not its URL)."""
    context = getattr(request, "context", None)
    if isinstance(context, dict):
        context["sparkpoint_url"] = request.url
        context["sparkpoint_head"] = request.method.upper() == "HEAD"


def _sent(request: Any, **_: Any) -> None:
    body = getattr(request, "body", None)
    size = int(request.headers.get("Content-Length") or 0) if body is not None else 0
    _TALLY.add(channel_of(_path_of(request.url)), operation_of(request.method, request.url, request.headers), size, 0)


def _received(response_dict: Any = None, context: Any = None, **_: Any) -> None:
    if not response_dict or (context or {}).get("sparkpoint_head"):  # a HEAD's length is the object's, unsent
        return
    size = int(response_dict.get("headers", {}).get("Content-Length") or 0)
    url = (context or {}).get("sparkpoint_url", "")
    if size:
        _TALLY.add_bytes(channel_of(_path_of(url)) if url else CHECKPOINT, size)
