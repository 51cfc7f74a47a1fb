"""The trainer: policy, reference, optimizer and loss. It turns a collected batch into an update; the piece that
data-parallel training shards. What a checkpoint keeps of it is :class:`torchrl_grpo.run.state.TrainerState`'s, the
weights an engine loads :class:`torchrl_grpo.training.weight_sync.PolicyWeights`'.

A step is :meth:`Trainer.prepare` (the log-probs only the policy's holder can compute, the KL penalty in
the reward, group advantages) then :meth:`Trainer.optimize` (``epochs`` passes of shuffled micro-batches,
gradient accumulation weighted so that an optimizer step sees exactly its whole batch's loss, clipping)
then the weights to the engine(s) (:mod:`torchrl_grpo.training.weight_sync` pushes them). The loss is asked about
a batch's rows once per step (:meth:`~torchrl_grpo.objective.loss.GRPOLoss.rows`): which tokens enter it, which rows
can move the weights, how much each micro-batch weighs.

With ``parallel`` (:mod:`torchrl_grpo.parallel.ranks`), the same loop runs on each of N ranks over a
policy sharded with FSDP2: every rank holds the whole batch and takes its share of each micro-batch, the
accumulation normaliser is summed over ranks, and the metrics are those of the whole micro-batches. The
methods that hold a collective are declared :func:`~torchrl_grpo.parallel.ranks.collective`: rank 0 announces
each call to the other ranks, which make the same call (:meth:`torchrl_grpo.parallel.ranks.DataParallel.follow`).
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch

from torchrl_grpo.config.settings import TrainSettings
from torchrl_grpo.core.batch import Batch
from torchrl_grpo.models.flops import model_shape, training_peak_flops, update_flops
from torchrl_grpo.objective.advantages import group_advantages
from torchrl_grpo.objective.aggregation import aggregate
from torchrl_grpo.objective.critic import (
    clipped_value_loss,
    explained_variance,
    gae,
    token_rewards,
    token_values,
    whiten,
)
from torchrl_grpo.objective.log_probs import token_log_probs
from torchrl_grpo.objective.loss import MAX_METRICS, GRPOLoss, LossRows, total_loss
from torchrl_grpo.parallel.ranks import DataParallel, collective, full_tensor
from torchrl_grpo.training.critic import Critic
from torchrl_grpo.training.micro_batches import MicroBatching, rows_to_train, trim_padding
from torchrl_grpo.training.no_signal import NoSignalWatch
from torchrl_grpo.training.recast import weights_recast_in_backward


@dataclass
class Tally:
    """What :meth:`Trainer.optimize` accumulates over a step's micro-batches and optimizer steps."""

    history: dict[str, list[float]] = field(default_factory=dict)  # each loss and diagnostic, per micro-batch
    share_weights: list[float] = field(default_factory=list)  # each micro-batch's accumulation weight
    trained_tokens: int = 0
    trained_rows: int = 0
    skipped: int = 0  # updates dropped for a non-finite gradient norm
    still: int = 0  # optimizer steps not taken: no row could move the weights
    optimizer_time: float = 0.0
    flops: int = 0
    lr: float | None = None  # the learning rate of the step's last update taken

    def add(self, key: str, value: float) -> None:
        self.history.setdefault(key, []).append(value)


class Trainer:
    def __init__(self, policy: torch.nn.Module, ref_policy: torch.nn.Module | None, loss: GRPOLoss,
                 optimizer: torch.optim.Optimizer, settings: TrainSettings, device: torch.device,
                 ref_device: torch.device | None, parallel: DataParallel | None = None,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None = None, critic: Critic | None = None):
        self.policy, self.ref_policy, self.loss, self.optimizer = policy, ref_policy, loss, optimizer
        self.critic = critic  # an actor-critic run's value model (on the policy's device); None: group advantages
        self.scheduler = scheduler  # the learning rate of each optimizer step; None: optimizer.lr throughout
        self.settings, self.device, self.ref_device = settings, device, ref_device
        self.parallel = parallel  # None: one process
        self.shuffle = torch.Generator().manual_seed(settings.seed)  # micro-batch order, saved for exact resume
        self.nonfinite_streak = 0  # optimizer steps in a row skipped for a non-finite gradient norm
        self.updates = 0  # optimizer steps taken by this trainer: the weights changed when it moved
        self.no_signal = NoSignalWatch(settings.no_signal_patience, settings.min_ess, settings.no_signal_stop)
        shapes = [model_shape(m) for m in (policy, *([] if critic is None else [critic.model]))]
        self.model_shapes = None if None in shapes else shapes  # None: a model without a transformers config
        self.micro = MicroBatching(settings.micro_batch, settings.micro_batch_tokens, parallel)
        ranks = 1 if parallel is None else parallel.world_size
        self.peak_flops = None if self.model_shapes is None else training_peak_flops(
            policy, device, settings.mixed_precision, ranks)

    @collective
    def prepare(self, batch) -> dict:
        """Make a collected batch trainable, in place: the policy's own log-probs before its update (when the
        ratio's denominator is the trainer's), the reference's, the KL penalty in the reward (k1 summed over
        the completion, with ``train.kl_coef_in_loss=false``) and the group advantages, or with a critic its
        per-token advantages (:meth:`critic_advantages`); returns metrics.

        When the step makes a single update (one epoch, one optimizer step) every training forward runs on the
        weights the batch's old log-probs would be computed with: the batch then carries none, and the loss
        takes its forward's own, detached (a ratio of exactly 1), saving that forward."""
        s, metrics, started = self.settings, {}, time.perf_counter()
        if s.recompute_old_log_probs and self.single_update(len(batch)):
            batch.pop(Batch.OLD_LOG_PROBS, None)
        elif s.recompute_old_log_probs:
            batch[Batch.OLD_LOG_PROBS] = self.log_probs(self.policy, self.device, batch)
            gap = (batch[Batch.OLD_LOG_PROBS] - batch[Batch.SAMPLE_LOG_PROBS]).abs()[batch[Batch.COMPLETION_MASK]]
            metrics["engine_trainer_logp_gap_max"] = gap.max().item()
        task_reward, kl_tokens = batch[Batch.REWARD], None
        if self.ref_policy is not None:
            batch[Batch.REF_LOG_PROBS] = self.log_probs(self.ref_policy, self.ref_device, batch)
            if s.kl_in_reward_coeff > 0:
                kl_tokens = (batch[Batch.SAMPLE_LOG_PROBS] - batch[Batch.REF_LOG_PROBS]) * batch[Batch.COMPLETION_MASK]
                kl = kl_tokens.sum(-1)
                batch[Batch.REWARD] = batch[Batch.REWARD] - s.kl_in_reward_coeff * kl
                metrics["kl_penalty_in_reward"] = kl.mean().item()
        if self.critic is None:
            advantage, tied = group_advantages(batch[Batch.REWARD], s.group_size, s.reward_scale)
            metrics["tied_group_fraction"] = tied.float().mean().item()
            advantage_abs = advantage.abs().mean()
        else:
            loss_mask = self.loss.token_mask(batch)
            advantage = self.critic_advantages(batch, task_reward, kl_tokens, loss_mask, metrics)
            advantage_abs = advantage.abs()[loss_mask].mean()
        batch[Batch.ADVANTAGE] = advantage
        metrics.update({
            "reward": batch[Batch.REWARD].mean().item(),
            "reward_std": batch[Batch.REWARD].std().item() if len(batch) > 1 else 0.0,
            "advantage_abs_mean": advantage_abs.item(),
            "prepare_time": time.perf_counter() - started,
        })
        return metrics

    def critic_advantages(self, batch, task_reward: torch.Tensor, kl_tokens: torch.Tensor | None,
                          loss_mask: torch.Tensor, metrics: dict) -> torch.Tensor:
        """GAE over the completion tokens from the critic's values (:func:`gae`): the task reward on each
        episode's last token, the KL penalty of the reward on every token; the values are kept as ``value_old``
        and the returns as ``return``, the value loss's targets. Returns the advantages [N, L], whitened over the
        batch's loss tokens (``loss_mask``) when ``critic.whiten_advantages``; adds the critic's metrics
        (``explained_variance`` of the returns by the values before the update, their means)."""
        c, mask = self.critic.settings, batch[Batch.COMPLETION_MASK]
        packed = self.settings.micro_batch_tokens is not None
        values = self._per_row(lambda mb: token_values(self.critic.model, mb[Batch.TOKENS], mb[Batch.ATTENTION_MASK],
                                                       mb[Batch.COMPLETION_MASK], packed), self.device, batch)
        rewards = token_rewards(task_reward, mask, kl_tokens, self.settings.kl_in_reward_coeff)
        advantage, returns = gae(rewards, values, mask, c.gamma, c.lmbda)
        batch[Batch.VALUE_OLD], batch[Batch.RETURN] = values, returns.float()
        metrics.update({"explained_variance": explained_variance(values, returns, mask),
                        "value_mean": values[mask].mean().item() if mask.any() else 0.0,
                        "return_mean": returns[mask].mean().item() if mask.any() else 0.0})
        return (whiten(advantage, loss_mask) if c.whiten_advantages else advantage).float()

    def single_update(self, rows: int) -> bool:
        """A step of ``rows`` completions makes one optimizer step, from the weights it was prepared with."""
        return self.settings.epochs == 1 and self.settings.micro_batch * self.settings.accumulation >= rows

    def log_probs(self, model: torch.nn.Module, device: torch.device, batch) -> torch.Tensor:
        """Completion-token log-probs of ``batch`` under ``model`` (reference, or the policy before its
        update), in the training's micro-batches; 0 outside completions. Data-parallel: each rank its shares of
        them, then put together."""
        packed = self.settings.micro_batch_tokens is not None
        return self._per_row(lambda mb: token_log_probs(model, mb[Batch.TOKENS], mb[Batch.ATTENTION_MASK],
                                                        self.settings.temperature, wanted=mb[Batch.COMPLETION_MASK],
                                                        packed=packed,
                                                        chunk_bytes=self.settings.log_prob_chunk_bytes)[0],
                             device, batch)

    @torch.no_grad()
    def _per_row(self, compute, device: torch.device, batch) -> torch.Tensor:
        """``compute(micro-batch)`` -> [n, l] per token over ``batch``, in the training's micro-batches
        (:attr:`micro`) on ``device``, as float32 [N, L] on the CPU. Data-parallel: each rank its shares,
        then every rank's rows put together."""
        out = torch.zeros_like(batch[Batch.SAMPLE_LOG_PROBS])
        for idx in self.micro.cut(torch.arange(len(batch)), batch[Batch.ATTENTION_MASK]):
            mb = trim_padding(batch[idx]).to(device)
            with self._autocast(device):
                values = compute(mb)
            out[idx, : values.shape[1]] = values.float().cpu()
        return out if self.parallel is None else self.parallel.sum_rows(out)

    @collective
    def optimize(self, batch) -> dict:
        """``epochs`` passes of shuffled micro-batches; one optimizer step per ``accumulation`` micro-batches.
        A non-finite gradient norm skips that update (counted in ``skipped_updates``). An optimizer step none of
        whose rows can move the weights (:attr:`LossRows.moving`: every advantage 0, no regulariser) is not
        taken (counted in ``still_updates``): its loss and diagnostics come from a forward without gradients, no
        backward runs, and neither the optimizer's state nor the learning-rate schedule moves, as if its rows had
        not been drawn (taken with a zero gradient, AdamW's momentum and weight decay would still move the
        weights). In an update that is taken, the rows that cannot move the weights skip the forward and
        backward, as far as whole micro-batches allow (:func:`rows_to_train`), and still count in the
        aggregation: the update is the one computing them gives, to float rounding. The loss diagnostics are
        then over the rows trained (``trained_row_fraction``). With a critic, its value loss is aggregated and
        weighted like the policy's in the same micro-batches, every row with a loss token trains it, and it steps
        with its own optimizer beside the policy's. Data-parallel: this rank's share of each micro-batch, weights
        normalised over the whole window's. ``signal_fraction``: the share of rows the reward teaches from.
        ``train_flops_per_s``: the model FLOPs of every forward and backward (:mod:`torchrl_grpo.models.flops`; all
        ranks') over ``train_time``; ``mfu``: that over :func:`~torchrl_grpo.models.flops.training_peak_flops`."""
        tally, started = Tally(), time.perf_counter()
        rows = self.loss.rows(batch)  # every rank holds the whole batch: they agree
        self._train_mode(True)
        for _ in range(self.settings.epochs):
            # each optimizer step's rows: a shuffled window
            size = self.settings.micro_batch * self.settings.accumulation
            for window in torch.randperm(len(batch), generator=self.shuffle).split(size):
                self._optimizer_step(batch, rows, window, tally)
        self._train_mode(False)
        return {"signal_fraction": rows.signal.float().mean().item(),
                **self._metrics(tally, len(batch), time.perf_counter() - started)}

    def _optimizer_step(self, batch, rows: LossRows, window: torch.Tensor, tally: Tally) -> None:
        """One optimizer step over the rows ``window``: its micro-batches planned (rows of similar lengths, or
        packed), each one's forward and backward, then the update (not taken when no row can move the weights)."""
        # the critic learns from every row with a loss token
        moving = rows.moving[window] if self.critic is None else rows.mask[window].any(-1)
        moves = bool(moving.any())
        trained = rows_to_train(window, moving, self.micro.fill) if moves else window
        tally.trained_rows += len(trained) if moves else 0
        order = self.micro.cut(trained, batch[Batch.ATTENTION_MASK])
        micro = [trim_padding(batch[idx]).to(self.device) for idx in order]
        weights = [rows.weight(idx) for idx in order]
        total = rows.weight(window)  # every row of the window counts
        tally.share_weights += weights
        for mb, weight, idx in zip(micro, weights, order):
            lengths = batch[Batch.ATTENTION_MASK][idx].sum(-1).tolist()  # from the batch as collected: no sync
            mask = rows.mask[idx][:, : mb[Batch.TOKENS].shape[1]].to(self.device)
            self._forward_backward(mb, mask, weight / max(total, 1e-9), moves, lengths, tally)
        if not moves:
            tally.still += 1
            tally.add("grad_norm", 0.0)
            return
        self._update(tally)

    def _forward_backward(self, mb, mask: torch.Tensor, share: float, moves: bool, lengths: list[int],
                          tally: Tally) -> None:
        """One micro-batch (``mask``: its loss tokens): its losses (and the critic's value loss), and when the step
        ``moves`` their backward, weighted by the micro-batch's ``share`` of the optimizer step's accumulation
        weight."""
        with self._autocast(), weights_recast_in_backward(), torch.set_grad_enabled(moves):
            losses = self.loss(mb)
            if self.critic is not None:
                losses.update(self._value_loss(mb, mask))
        if moves:
            objective = total_loss(losses) + (0 if self.critic is None else losses["value_loss"])
            (objective * share).backward()
        for key, value in losses.items():
            tally.add(key, value.detach().float().item())
        tally.trained_tokens += sum(lengths)
        if self.model_shapes is not None:
            tally.flops += update_flops(self.model_shapes, lengths, moves)

    def _update(self, tally: Tally) -> None:
        """The optimizer steps, the critic's and the policy's, each clipped; a non-finite gradient norm skips the
        policy's (counted, and in a streak that :meth:`divergence` watches)."""
        clip = self.settings.clip_grad_norm
        if self.critic is not None:  # its own optimizer, clipped like the policy's
            tally.add("critic_grad_norm", clipped_step(self.critic.trainable(), self.critic.optimizer,
                                                       self.critic.scheduler, clip).item())
        started = time.perf_counter()
        tally.lr = self.optimizer.param_groups[0]["lr"]  # this update's
        params = [p for p in self.policy.parameters() if p.requires_grad]
        grad_norm = clipped_step(params, self.optimizer, self.scheduler, clip)
        if torch.isfinite(grad_norm):
            self.updates += 1
            self.nonfinite_streak = 0
        else:  # a NaN/inf gradient would poison the weights: the update was dropped, say so in the metrics
            tally.skipped += 1
            self.nonfinite_streak += 1
        tally.optimizer_time += time.perf_counter() - started
        tally.add("grad_norm", grad_norm.item())

    def _train_mode(self, on: bool) -> None:
        for model in (self.policy, None if self.critic is None else self.critic.model):
            if model is not None:
                model.train(on)

    def _metrics(self, tally: Tally, rows: int, elapsed: float) -> dict:
        """The step's metrics from ``tally`` (data-parallel: the whole micro-batches', over all ranks): means of
        the losses and diagnostics (the largest of :data:`MAX_METRICS`), the counts, time and throughput."""
        history, trained_tokens, flops = tally.history, tally.trained_tokens, tally.flops
        if self.parallel is not None:
            history = self.parallel.global_history(history, tally.share_weights)
            trained_tokens = self.parallel.sum(trained_tokens)
            flops = self.parallel.sum(flops)
        metrics = {key: sum(v) / len(v) for key, v in history.items()}
        metrics["loss"] = sum(metrics[k] for k in metrics if k.startswith("loss_"))
        metrics["clip_fraction"] = metrics["clip_fraction_low"] + metrics["clip_fraction_high"]
        metrics.update({key: max(history[key]) for key in MAX_METRICS if key in history})
        metrics.update({"skipped_updates": tally.skipped, "still_updates": tally.still,
                        "trained_row_fraction": tally.trained_rows / (rows * self.settings.epochs),
                        "lr": self.optimizer.param_groups[0]["lr"] if tally.lr is None else tally.lr,
                        "train_time": elapsed, "optimizer_time": tally.optimizer_time,
                        "train_tokens_per_s": trained_tokens / max(elapsed, 1e-9)})
        if self.model_shapes is not None:
            metrics["train_flops_per_s"] = flops / max(elapsed, 1e-9)
        if self.peak_flops is not None:
            metrics["mfu"] = metrics["train_flops_per_s"] / self.peak_flops
        return metrics

    def _value_loss(self, mb, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The critic's clipped value loss on a micro-batch (:func:`clipped_value_loss`), aggregated over its loss
        tokens (``mask``) like the policy's loss, and the share of them whose clipped branch was taken."""
        values = token_values(self.critic.model, mb[Batch.TOKENS], mb[Batch.ATTENTION_MASK], mb[Batch.COMPLETION_MASK],
                              self.settings.micro_batch_tokens is not None)
        loss, clipped = clipped_value_loss(values, mb[Batch.VALUE_OLD], mb[Batch.RETURN],
                                           self.critic.settings.value_clip)
        return {"value_loss": aggregate(loss, mask, self.loss.aggregation, self.loss.aggregation_constant),
                "value_clip_fraction": (clipped & mask).sum() / mask.sum().clamp(min=1)}

    def divergence(self) -> str | None:
        """Why training cannot go on, or None: ``train.max_nonfinite_updates`` updates in a row were skipped for
        a non-finite gradient norm (one is noise; a streak means every step would be thrown away)."""
        limit = self.settings.max_nonfinite_updates
        if not limit or self.nonfinite_streak < limit:
            return None
        return (f"{self.nonfinite_streak} updates in a row had a non-finite gradient norm and were skipped "
                f"(train.max_nonfinite_updates={limit}); likely causes: a learning rate too high "
                f"(optimizer.lr={self.optimizer.param_groups[0]['lr']:g}), bf16 overflow (try "
                "train_model.torch_dtype=float32), or an empty loss mask (e.g. loss.overlong=mask with every "
                "completion truncated: raise inference_model.max_tokens)")

    def _autocast(self, device: torch.device | None = None):
        """``train.mixed_precision`` (resolved: :mod:`torchrl_grpo.config.precision`): bf16 compute over the float32
        master weights and optimizer state. The log-probs the ratio divides by are computed under it too, so a
        ratio is 1 where the policy has not moved. No cast cache: a forward uses each weight once, and with
        ``train_model.gradient_checkpointing`` the cache would hold a bf16 copy of every weight (0.25 GiB for
        SmolLM2-135M) that the checkpointed layers do not need until their recompute."""
        device = self.device if device is None else device
        if self.settings.mixed_precision and device.type in ("cuda", "cpu"):
            return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False)
        return contextlib.nullcontext()

def clipped_step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, scheduler, clip: float | None):
    """One optimizer step on the accumulated gradients of ``params``, clipped to norm ``clip`` (None: not clipped),
    the schedule after it; a non-finite norm skips both (the schedule stays where it is). The gradients are zeroed
    either way. Returns the norm before clipping (data-parallel: over the whole sharded parameters)."""
    grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(params, clip or math.inf))
    if torch.isfinite(grad_norm):
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm
