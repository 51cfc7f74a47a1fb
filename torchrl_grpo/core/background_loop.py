"""An asyncio event loop in a daemon thread of its own, so synchronous code on any thread (collector, reward
threads, Ray actors) can run an async client's coroutines on the loop their connections belong to."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any


class BackgroundLoop:
    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name=name, daemon=True).start()

    def submit(self, coroutine: Coroutine, timeout_s: float | None = None) -> concurrent.futures.Future:
        """Schedule ``coroutine`` (cancelled after ``timeout_s``: TimeoutError); its future, waitable anywhere."""
        if timeout_s is not None:
            coroutine = asyncio.wait_for(coroutine, timeout_s)
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine, timeout_s: float | None = None) -> Any:
        """Run ``coroutine`` on the loop and wait for its result (or its exception)."""
        return self.submit(coroutine, timeout_s).result()
