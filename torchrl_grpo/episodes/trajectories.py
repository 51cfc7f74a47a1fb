"""From prompts to a scored TensorDict of trajectories: what one collection step produces.

The batch's keys, shapes and dtypes: :class:`torchrl_grpo.core.batch.Batch`.
"""
from __future__ import annotations

import torch
from tensordict import TensorDict

from torchrl_grpo.core.batch import Batch
from torchrl_grpo.tasks import Task


class PromptSampler:
    """Prompts in a shuffled order, reshuffled at each pass over the dataset; its state resumes exactly."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed = size, seed
        self.epoch, self.position = 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffle()
            out.append(self._order[self.position])
            self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"size": self.size, "seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.size, self.seed, self.epoch, self.position = (state[k] for k in ("size", "seed", "epoch", "position"))
        self._order = self._shuffle()


def prompt_token_ids(task: Task, tokenizer, rows: list[dict]) -> list[list[int]]:
    """Chat-templated prompt ids (the template's own special tokens, none added on top; the task's
    ``chat_template_kwargs`` passed to the template)."""
    texts = [tokenizer.apply_chat_template(task.messages(r), tokenize=False, add_generation_prompt=True,
                                           **task.chat_template_kwargs) for r in rows]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def build_batch(played, group_size: int, pad_id: int, version: int) -> TensorDict:
    """Pack episodes (:class:`torchrl_grpo.episodes.play.Played`, ``group_size`` consecutive ones per prompt) into
    tensors: their ids as they are, the loss mask on the ids the engine sampled (not the prompt, not what an
    environment inserted between turns), the sampling log-probs there. Streamed episodes (each with the policy
    version of every completion token) carry those versions, and their oldest as the row's policy version; others
    were sampled by policy ``version``."""
    n, length = len(played), max(len(p.episode.tokens) for p in played)
    tokens = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros(n, length, dtype=torch.bool)
    completion_mask = torch.zeros(n, length, dtype=torch.bool)
    log_probs = torch.zeros(n, length, dtype=torch.float32)
    for i, p in enumerate(played):
        size = len(p.episode.tokens)
        tokens[i, :size] = torch.tensor(p.episode.tokens)
        attention[i, :size] = True
        completion_mask[i, :size] = torch.tensor(p.episode.sampled, dtype=torch.bool)
        log_probs[i, :size] = torch.tensor(p.episode.log_probs, dtype=torch.float32)
    batch = TensorDict(
        {
            Batch.TOKENS: tokens,
            Batch.ATTENTION_MASK: attention,
            Batch.COMPLETION_MASK: completion_mask,
            Batch.SAMPLE_LOG_PROBS: log_probs,
            Batch.TRUNCATED: torch.tensor([p.finish_reason == "length" for p in played]),
            Batch.GROUP: torch.arange(n) // group_size,
            Batch.POLICY_VERSION: torch.full((n,), version, dtype=torch.long),
        },
        batch_size=[n],
    )
    if played and all(p.versions is not None for p in played):
        versions = torch.full((n, length), -1, dtype=torch.long)
        for i, p in enumerate(played):
            versions[i][completion_mask[i]] = torch.tensor(p.versions, dtype=torch.long)
        batch[Batch.TOKEN_VERSIONS] = versions
        batch[Batch.POLICY_VERSION] = torch.tensor([min(p.versions, default=version) for p in played])
    return batch


def reward_tensors(task: Task, components: list[dict]) -> TensorDict:
    """Each reward component (``("rewards", name)``) and the weighted total (``reward``) per completion,
    from ``task.score`` outputs in batch order."""
    per_name = {name: torch.tensor([c[name] for c in components]) for name in task.reward_names}
    total = torch.tensor([task.total(c) for c in components])
    return TensorDict({Batch.REWARD: total, Batch.REWARDS: TensorDict(per_name, batch_size=[len(components)])},
                      batch_size=[len(components)])
