"""Runs that learn nothing, said while they run: steps on end where no completion carries a reward signal (every
group tied, or every token out of the loss), or where the importance weights have collapsed. Each step is cheap
to watch (the loop's metrics); the watch names the cause and the key to change after ``train.no_signal_patience``
steps in a row, and again every as many steps while it lasts; with ``train.no_signal_stop`` the run stops there
with a checkpoint instead.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class NoSignalWatch:
    """Streaks of silent steps (``signal_fraction == 0``) and of collapsed importance weights
    (``ess < min_ess``); ``patience`` 0 watches nothing."""

    patience: int
    min_ess: float
    stop: bool
    silent_steps: int = 0
    collapsed_steps: int = 0

    def observe(self, metrics: dict) -> str | None:
        """Count this step; the warning to print (without ``warning: ``) when a streak reaches the patience or
        a multiple of it, else None."""
        if not self.patience:
            return None
        self.silent_steps = self.silent_steps + 1 if metrics.get("signal_fraction", 1.0) == 0 else 0
        self.collapsed_steps = self.collapsed_steps + 1 if metrics.get("ess", 1.0) < self.min_ess else 0
        due = [n for n in (self.silent_steps, self.collapsed_steps) if n and n % self.patience == 0]
        return self.cause(metrics) if due else None

    def cause(self, metrics: dict) -> str | None:
        """Why the run is learning nothing, with the keys to change; None while neither streak is long enough."""
        if self.patience and self.silent_steps >= self.patience:
            if metrics.get("tied_group_fraction", 0.0) == 1.0:
                why = (f"every group's rewards tied (mean reward {metrics.get('reward', float('nan')):.4g}): make "
                       "completions differ (env.repeats, inference_model.temperature), use a reward that separates "
                       "them, or set loss.dynamic_sampling=true")
            else:
                why = ("no completion with a nonzero advantage kept a loss token (loss.overlong=mask leaves truncated "
                       "completions out): raise inference_model.max_tokens or set loss.overlong=soft")
            return f"no completion carried a learning signal for {self.silent_steps} steps in a row: {why}"
        if self.patience and self.collapsed_steps >= self.patience:
            return (f"the importance weights collapsed for {self.collapsed_steps} steps in a row (ess "
                    f"{metrics.get('ess', float('nan')):.3g} < train.min_ess={self.min_ess:g}): the trained policy is "
                    "far from the one that sampled; lower optimizer.lr, train.epochs or train.max_staleness")
        return None

    def stop_reason(self, metrics: dict) -> str | None:
        """The cause, when ``stop`` asks the run to end on it."""
        return self.cause(metrics) if self.stop else None
