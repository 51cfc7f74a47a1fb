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
from omegaconf import DictConfig


@dataclass(frozen=True)
class CriticSettings:
    """The ``critic.*`` keys the trainer reads."""

    gamma: float                    # critic.gamma: the discount per token
    lmbda: float                    # critic.lmbda: GAE's lambda
    value_clip: float | None        # critic.value_clip: V within V_old +- it in the value loss; None: unclipped
    whiten_advantages: bool         # critic.whiten_advantages: advantages normalised over the batch's tokens

    @classmethod
    def from_config(cls, cfg: DictConfig) -> CriticSettings:
        c = cfg.critic
        return cls(gamma=float(c.gamma), lmbda=float(c.lmbda),
                   value_clip=None if c.value_clip is None else float(c.value_clip),
                   whiten_advantages=bool(c.whiten_advantages))


@dataclass
class Critic:
    """The value model (a transformers ``...ForTokenClassification`` with one label), its optimizer and schedule."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    settings: CriticSettings
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]
