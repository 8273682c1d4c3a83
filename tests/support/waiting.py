"""The one wait of the tests: poll a condition until a deadline, and say what was waited for."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(
    condition: Callable[[], Any],
    timeout: float = 20.0,
    interval: float = 0.1,
    what: str | Callable[[], str] = "the condition",
):
    """The condition's first true result; an AssertionError naming `what` once `timeout` seconds pass.

    `what` may be a function, called on the timeout, so the message carries the state then
    (a fleet's replicas, a process's log), not the state when the wait began.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(interval)
    said = what() if callable(what) else what
    raise AssertionError(f"timed out after {timeout}s waiting for {said}")
