"""Loaded (as ``sitecustomize``) by the processes the fault harness runs under libfaketime.

libfaketime 0.9.10 with ``FAKETIME_DONT_FAKE_MONOTONIC=1`` makes ``time.sleep()`` fail
with ``EINVAL`` (Python sleeps with ``clock_nanosleep`` on the monotonic clock), while
every other wait (locks, events, ``select``, socket timeouts) works. Here ``time.sleep``
waits on an event instead, so the process sees only the clock offset.
"""

import os
import threading
import time

if "FAKETIME" in os.environ or "FAKETIME_TIMESTAMP_FILE" in os.environ:
    _waiter = threading.Event()

    def _sleep(seconds: float) -> None:
        if seconds < 0:
            raise ValueError("sleep length must be non-negative")
        _waiter.wait(seconds)

    time.sleep = _sleep
