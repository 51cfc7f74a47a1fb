"""Stopping a run without losing it: the first SIGINT/SIGTERM asks the loop to stop after the current step
with a checkpoint; a second one interrupts at once."""
from __future__ import annotations

import signal
import sys


class StopRequest:
    """A context manager: inside it ``requested`` turns true on the first SIGINT/SIGTERM."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self):
        self.requested = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\n{signal.Signals(signum).name}: finishing this step and saving a checkpoint "
              "(send it again to stop at once)", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False
