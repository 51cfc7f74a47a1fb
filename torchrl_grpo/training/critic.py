"""The critic of an actor-critic run (``loss=ppo``, ``loss.advantage=gae``): a value model of its own beside the
policy, with its optimizer and learning-rate schedule. The trainer computes its values before a step (GAE's
baselines) and trains it in the same micro-batches as the policy (:mod:`torchrl_grpo.objective.critic` has the
terms).

A separate model rather than a value head on the policy: the value loss then never pulls on the policy's features
(what verl and OpenRLHF do too), and the critic has its own learning rate, at the cost of a second model's weights,
gradients and optimizer state in training memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from torchrl_grpo.config.settings import CriticSettings


@dataclass
class Critic:
    """The value model (a transformers ``...ForTokenClassification`` with one label), its optimizer and schedule."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    settings: CriticSettings
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]
