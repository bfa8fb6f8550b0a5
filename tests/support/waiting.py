"""Waiting for what another process or thread does: the one polling loop of the tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float, interval: float = 0.2, what: str = "the condition", *,
             stop: Callable[[], str | None] | None = None, last: Callable[[], Any] | None = None) -> T:
    """Call `predicate` every `interval` seconds until it returns something truthy; return that.

    Args:
        predicate: what is awaited; its first truthy value is returned.
        timeout: seconds before giving up.
        interval: seconds between two calls.
        what: the awaited thing, as the failure names it ("dagster dev to answer").
        stop: a reason to give up at once (the server being waited for has exited), or None.
        last: the state a failure shows, e.g. the log's tail.

    Raises:
        AssertionError: after `timeout` seconds, or as soon as `stop` gives a reason.
    """
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        reason = stop() if stop is not None else None
        if reason or time.monotonic() > deadline:
            why = f"{reason} while" if reason else f"timed out after {timeout:g} s"
            raise AssertionError(f"{why} waiting for {what}" + (f"; last: {last()}" if last is not None else ""))
        time.sleep(interval)
    return value
