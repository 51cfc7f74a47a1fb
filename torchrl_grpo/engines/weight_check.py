"""Is the engine sampling from the trainer's weights? A fixed probe text is scored by both (log-prob of each
token given the ones before it, temperature 1) and the mean absolute difference is compared with a
tolerance for the lower of the two precisions.

At start-up the gap is measured and printed in one line (a warning above the tolerance: an engine that does
not reproduce the trainer's model, e.g. another dtype or a kernel that differs, makes every importance ratio
off). After every weight push it is measured again and a gap above ``max(tolerance, 2 x the start-up gap)``
stops the run: the push did not (fully) land. A push that changes nothing is caught at once, whatever the
dtypes: the engine's probe log-probs stay bit for bit what they were while the trainer's moved (by more than
``MOVED`` on average). With a bf16 engine the gap alone would only catch it once the policy has moved 0.1 per
token away from the weights the engine still holds, which can take a whole run.

Tolerances of the mean |difference| (measured on SmolLM2-135M, CPU, this probe, against float32:
bfloat16 0.035, float16 0.0043; vLLM float32 against transformers float32 ~1e-5): ``DEFAULT_TOLERANCE``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from torchrl_grpo.core.errors import RunError
from torchrl_grpo.objective.log_probs import token_log_probs

PROBE_TEXT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
              "How many clips did Natalia sell altogether in April and May? In May she sold 48 / 2 = 24 clips, "
              "so 48 + 24 = 72 clips in all.")
DEFAULT_TOLERANCE = {torch.float32: 5e-3, torch.float16: 0.02, torch.bfloat16: 0.1}
# the trainer's probe log-probs moved by more than this (mean |change|) since the last push: the engine's must
# change too. Below it an update may leave every weight's bf16 rounding as it was (e.g. LoRA's first steps).
MOVED = 1e-3


def probe_ids(tokenizer) -> list[int]:
    return [int(t) for t in tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]]


@torch.no_grad()
def probe_log_probs(model: torch.nn.Module, token_ids: Sequence[int]) -> torch.Tensor:
    """Float32 log-probs of ``token_ids[1:]`` under ``model``, each given the tokens before it."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(token_ids)], device=device)
    log_probs, _ = token_log_probs(model, ids, torch.ones_like(ids))
    return log_probs[0, 1:].float().cpu()


def tolerance(engine_dtype: torch.dtype, trainer_dtype: torch.dtype, configured: float | None) -> float:
    """``configured``, else the default of the less precise of the two dtypes."""
    if configured is not None:
        return float(configured)
    return max(DEFAULT_TOLERANCE.get(engine_dtype, 0.1), DEFAULT_TOLERANCE.get(trainer_dtype, 0.1))


@dataclass
class Probe:
    """What an engine needs to check itself after a push: the probe, the trainer's log-probs of it, the
    limit. Plain data, so that it travels to a Ray actor with the weights."""

    token_ids: list[int]
    trainer_log_probs: torch.Tensor
    limit: float
    trainer_moved: float = 0.0  # mean |change| of the trainer's log-probs since the previous probe

    def scores(self, engine) -> torch.Tensor:
        return torch.tensor(engine.score(self.token_ids), dtype=torch.float32)

    def gap(self, scores: torch.Tensor) -> float:
        """Mean |engine - trainer| log-prob over the probe's tokens."""
        return (scores - self.trainer_log_probs).abs().mean().item()

    def problem(self, gap: float, scores: torch.Tensor, before: torch.Tensor | None) -> str | None:
        """Why the engine (its probe ``scores`` now, at ``gap`` from the trainer's; ``before`` this push) does
        not hold the trainer's weights, or None."""
        return sync_problem(gap, self.limit) or unchanged_problem(scores, before, self.trainer_moved)

    def verify(self, engine, before: torch.Tensor | None) -> tuple[float, torch.Tensor]:
        """After a push: the gap and the engine's scores (the next push's ``before``), or a RunError when the
        engine does not hold the trainer's weights."""
        scores = self.scores(engine)
        gap = self.gap(scores)
        problem = self.problem(gap, scores, before)
        if problem:
            raise RunError(problem)
        return gap, scores


def unchanged_problem(scores: torch.Tensor, before: torch.Tensor | None, trainer_moved: float) -> str | None:
    """A push that changed nothing: the engine's probe scores are ``before``'s bit for bit while the trainer's
    moved by more than ``MOVED``."""
    if before is None or trainer_moved <= MOVED or not torch.equal(scores, before):
        return None
    return (f"weight sync check failed: after the push the engine's log-probs of the probe text are unchanged, bit "
            f"for bit, while the trainer's moved by {trainer_moved:.3g} on average: the engine did not take the new "
            "weights (check the weight names its loader takes)")


def sync_problem(gap: float, limit: float) -> str | None:
    """Why a push's ``gap`` means the engine does not hold the trainer's weights, or None."""
    if gap <= limit:
        return None  # NaN is not
    return (f"weight sync check failed: after the push the engine's log-probs of the probe text differ from the "
            f"trainer's by {gap:.3g} on average (limit {limit:.3g}): the engine did not take the new weights "
            "(check the weight names its loader takes; set train.weight_sync_tolerance if this engine is known to "
            "differ more)")


class WeightCheck:
    """The trainer's side (``policy``: the trained model): measures the start-up gap and makes the
    :class:`Probe` of each push. ``log_probs(token_ids)`` scores the probe (default :func:`probe_log_probs`
    of ``policy``; the trainer's own, which a sharded policy needs)."""

    def __init__(self, policy: torch.nn.Module, tokenizer, engine_dtype: torch.dtype, configured: float | None,
                 log_probs: Callable[[list[int]], torch.Tensor] | None = None):
        self.token_ids = probe_ids(tokenizer)
        self.log_probs = log_probs or (lambda token_ids: probe_log_probs(policy, token_ids))
        self.trainer_dtype = next(policy.parameters()).dtype
        self.engine_dtype = engine_dtype
        self.tolerance = tolerance(engine_dtype, self.trainer_dtype, configured)
        self.limit = self.tolerance
        self.trainer_before: torch.Tensor | None = None  # the previous probe's trainer log-probs
        self.engine_before: torch.Tensor | None = None  # the engine's scores at the last check (this process's)
        self.fault: str | None = None  # why the last check found the engine without the trainer's weights

    def probe(self) -> Probe:
        """The probe for the trainer's current weights (and how far they moved since the previous probe)."""
        now = self.log_probs(self.token_ids)
        moved = 0.0 if self.trainer_before is None else (now - self.trainer_before).abs().mean().item()
        self.trainer_before = now
        return Probe(self.token_ids, now, self.limit, moved)

    def after_push(self, engine) -> float:
        """Check ``engine`` after a push: returns the gap (``weight_sync_gap``) and sets :attr:`fault`."""
        probe = self.probe()
        scores = probe.scores(engine)
        gap = probe.gap(scores)
        self.fault = probe.problem(gap, scores, self.engine_before)
        self.engine_before = scores
        return gap

    def startup(self, engine) -> str:
        """Measure the gap of the engine as started; set the limit of later checks; the line to print."""
        probe = self.probe()
        self.engine_before = probe.scores(engine)
        gap = probe.gap(self.engine_before)
        self.limit = max(self.tolerance, 2 * gap)
        dtypes = f"engine {str(self.engine_dtype).removeprefix('torch.')}, trainer " \
                 f"{str(self.trainer_dtype).removeprefix('torch.')}"
        line = (f"weight sync check: engine and trainer log-probs of a {len(self.token_ids)}-token probe differ by "
                f"{gap:.2g} on average ({dtypes}; tolerance {self.tolerance:.2g}), checked after every push")
        if not gap <= self.tolerance:
            line = (f"warning: {line}; the engine does not reproduce the trainer's model: importance ratios will be "
                    "off (compare inference_model.torch_dtype with train_model.torch_dtype)")
        return line
