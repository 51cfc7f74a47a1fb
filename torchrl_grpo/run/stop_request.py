"""Stopping a run without losing it: the first SIGINT/SIGTERM asks the loop to stop after the current step
with a checkpoint; a second SIGINT (Ctrl-C again) interrupts at once. A second SIGTERM is the same request: a
scheduler's preemption signals every process of the job, and some pass it on (srun to its tasks, Ray's daemons to
the driver), so one preemption can reach the trainer more than once; the scheduler's SIGKILL ends it at once."""
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
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.requested = True
        again = "press Ctrl-C again" if signum == signal.SIGINT else "SIGINT or SIGKILL"
        print(f"\n{signal.Signals(signum).name}: finishing this step and saving a checkpoint ({again} to stop at "
              "once)", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False
