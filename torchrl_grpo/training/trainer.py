"""The trainer: policy, reference, optimizer and loss. It turns a collected batch into an update and gives
the weights to push; the piece that data-parallel training shards.

A step is :meth:`Trainer.prepare` (the log-probs only the policy's holder can compute, the KL penalty in
the reward, group advantages) then :meth:`Trainer.optimize` (``epochs`` passes of shuffled micro-batches,
gradient accumulation weighted so that an optimizer step sees exactly its whole batch's loss, clipping)
then the weights to the engine(s) (:mod:`torchrl_grpo.training.weight_sync` pushes them).

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
from pathlib import Path

import torch

from torchrl_grpo.config.settings import TrainSettings
from torchrl_grpo.core.batch import Batch
from torchrl_grpo.core.checkpoint import CRITIC_DIR, OPTIMIZER_SHARDS, Key
from torchrl_grpo.engines.weight_check import probe_log_probs
from torchrl_grpo.engines.weight_stream import StreamedWeights
from torchrl_grpo.models.adapter import Adapter, adapter_config, adapter_weights
from torchrl_grpo.models.flops import bf16_peak_flops, model_shape, update_flops
from torchrl_grpo.models.loading import merged_state_dict, merged_weights
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
from torchrl_grpo.objective.loss import MAX_METRICS, GRPOLoss, total_loss
from torchrl_grpo.parallel.ranks import DataParallel, collective, full_tensor, gathered, load_optimizer, save_optimizer
from torchrl_grpo.training.critic import Critic
from torchrl_grpo.training.micro_batches import by_length, packed_micro_batches, rows_to_train, trim_padding
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
        self.peak_flops = self._peak_flops()

    def _peak_flops(self) -> float | None:
        """What ``mfu`` divides by: the dense bf16 peak of the GPUs the policy trains on (all ranks'), when its
        matmuls run in bf16 (autocast, or bf16 weights); None elsewhere (a CPU, float32, a GPU not in the table)."""
        if self.model_shapes is None or self.device.type != "cuda":
            return None
        if not (self.settings.mixed_precision or self.policy.get_input_embeddings().weight.dtype == torch.bfloat16):
            return None
        peak = bf16_peak_flops(torch.cuda.get_device_name(self.device))
        devices = len({p.device for p in self.policy.parameters()}) * (self.parallel.world_size if self.parallel else 1)
        return None if peak is None else peak * devices

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
        loss_mask = self.loss.token_mask(batch)
        if self.critic is None:
            advantage, tied = group_advantages(batch[Batch.REWARD], s.group_size, s.reward_scale)
            metrics["tied_group_fraction"] = tied.float().mean().item()
        else:
            advantage = self.critic_advantages(batch, task_reward, kl_tokens, loss_mask, metrics)
        batch[Batch.ADVANTAGE] = advantage
        metrics.update({
            "signal_fraction": self.loss.signal_rows(batch).float().mean().item(),
            "reward": batch[Batch.REWARD].mean().item(),
            "reward_std": batch[Batch.REWARD].std().item() if len(batch) > 1 else 0.0,
            "advantage_abs_mean": (advantage.abs().mean() if advantage.dim() == 1
                                   else advantage.abs()[loss_mask].mean()).item(),
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
                                                        packed=packed)[0],
                             device, batch)

    @torch.no_grad()
    def _per_row(self, compute, device: torch.device, batch) -> torch.Tensor:
        """``compute(micro-batch)`` -> [n, l] per token over ``batch``, in the training's micro-batches
        (:meth:`_micro_batches`) on ``device``, as float32 [N, L] on the CPU. Data-parallel: each rank its shares,
        then every rank's rows put together."""
        out = torch.zeros_like(batch[Batch.SAMPLE_LOG_PROBS])
        for idx in self._micro_batches(torch.arange(len(batch)), batch[Batch.ATTENTION_MASK]):
            mb = trim_padding(batch[idx]).to(device)
            with self._autocast(device):
                values = compute(mb)
            out[idx, : values.shape[1]] = values.float().cpu()
        return out if self.parallel is None else self.parallel.sum_rows(out)

    @property
    def _rows_per_micro_batch(self) -> int:
        """What the rows trained are filled up to a multiple of: a micro-batch's rows, or with packing, a row per
        rank (each takes part in every micro-batch)."""
        if self.settings.micro_batch_tokens is None:
            return self.settings.micro_batch
        return 1 if self.parallel is None else self.parallel.world_size

    def _micro_batches(self, rows: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        """This rank's rows (batch indices) of each micro-batch over ``rows``: ``train.optim_batch_size`` rows of
        similar lengths (data-parallel: this rank's share of them), or packed by ``train.micro_batch_tokens``
        (:func:`~torchrl_grpo.training.micro_batches.packed_micro_batches`). Every rank gets as many micro-batches."""
        s, parallel = self.settings, self.parallel
        if s.micro_batch_tokens is not None:
            ranks, rank = (1, 0) if parallel is None else (parallel.world_size, parallel.rank)
            plan = packed_micro_batches(rows, attention_mask[rows].sum(-1), s.micro_batch_tokens, ranks)
            return [shares[rank] for shares in plan]
        order = by_length(rows, attention_mask).split(s.micro_batch)
        return list(order) if parallel is None else [idx[parallel.share(len(idx))] for idx in order]

    @collective
    def optimize(self, batch) -> dict:
        """``epochs`` passes of shuffled micro-batches; one optimizer step per ``accumulation`` micro-batches.
        A non-finite gradient norm skips that update (counted in ``skipped_updates``). An optimizer step none of
        whose rows can move the weights (:meth:`GRPOLoss.moving_rows`: every advantage 0, no regulariser) is not
        taken (counted in ``still_updates``): its loss and diagnostics come from a forward without gradients, no
        backward runs, and neither the optimizer's state nor the learning-rate schedule moves, as if its rows had
        not been drawn (taken with a zero gradient, AdamW's momentum and weight decay would still move the
        weights). In an update that is taken, the rows that cannot move the weights skip the forward and
        backward, as far as whole micro-batches allow (:func:`rows_to_train`), and still count in the
        aggregation: the update is the one computing them gives, to float rounding. The loss diagnostics are
        then over the rows trained (``trained_row_fraction``). With a critic, its value loss is aggregated and
        weighted like the policy's in the same micro-batches, every row with a loss token trains it, and it steps
        with its own optimizer beside the policy's. Data-parallel: this rank's share of each micro-batch, weights
        normalised over the whole window's. ``train_flops_per_s``: the model FLOPs of every forward and backward
        (:mod:`torchrl_grpo.models.flops`; all ranks') over ``train_time``; ``mfu``: that over :meth:`_peak_flops`."""
        tally, started = Tally(), time.perf_counter()
        self._train_mode(True)
        for _ in range(self.settings.epochs):
            # each optimizer step's rows: a shuffled window
            size = self.settings.micro_batch * self.settings.accumulation
            for window in torch.randperm(len(batch), generator=self.shuffle).split(size):
                self._optimizer_step(batch, window, tally)
        self._train_mode(False)
        return self._metrics(tally, len(batch), time.perf_counter() - started)

    def _optimizer_step(self, batch, window: torch.Tensor, tally: Tally) -> None:
        """One optimizer step over the rows ``window``: its micro-batches planned (rows of similar lengths, or
        packed), each one's forward and backward, then the update (not taken when no row can move the weights)."""
        # every rank holds the whole batch: they agree; the critic learns from every row with a loss token
        moving = (self.loss.moving_rows(batch[window]) if self.critic is None
                  else self.loss.token_mask(batch[window]).any(-1))
        moves = bool(moving.any())
        rows = rows_to_train(window, moving, self._rows_per_micro_batch) if moves else window
        tally.trained_rows += len(rows) if moves else 0
        order = self._micro_batches(rows, batch[Batch.ATTENTION_MASK])
        micro = [trim_padding(batch[idx]).to(self.device) for idx in order]
        weights = [self.loss.accumulation_weight(mb) for mb in micro]
        total = self.loss.accumulation_weight(batch[window])  # every row of the window counts
        tally.share_weights += weights
        for mb, weight, idx in zip(micro, weights, order):
            lengths = batch[Batch.ATTENTION_MASK][idx].sum(-1).tolist()  # from the batch as collected: no sync
            self._forward_backward(mb, weight / max(total, 1e-9), moves, lengths, tally)
        if not moves:
            tally.still += 1
            tally.add("grad_norm", 0.0)
            return
        self._update(tally)

    def _forward_backward(self, mb, share: float, moves: bool, lengths: list[int], tally: Tally) -> None:
        """One micro-batch: its losses (and the critic's value loss), and when the step ``moves`` their backward,
        weighted by the micro-batch's ``share`` of the optimizer step's accumulation weight."""
        with self._autocast(), weights_recast_in_backward(), torch.set_grad_enabled(moves):
            losses = self.loss(mb)
            if self.critic is not None:
                losses.update(self._value_loss(mb))
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

    def _value_loss(self, mb) -> dict[str, torch.Tensor]:
        """The critic's clipped value loss on a micro-batch (:func:`clipped_value_loss`), aggregated over its loss
        tokens like the policy's loss, and the share of them whose clipped branch was taken."""
        mask = self.loss.token_mask(mb)
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

    @collective
    def weights(self) -> dict[str, torch.Tensor] | StreamedWeights:
        """The policy's HF-named weights (LoRA merged in): what an engine loads. Data-parallel: on rank 0 each
        is gathered from the shards when the consumer reaches it (:class:`StreamedWeights`: read them once, to
        the end), while the other ranks gather them all in step and keep none (an empty dict)."""
        if self.parallel is None:
            return merged_state_dict(self.policy)
        if self.parallel.rank == 0:
            return StreamedWeights(list(merged_weights(self.policy, shapes_only=True)), merged_weights(self.policy))
        return gathered(merged_weights(self.policy), keep=False)

    @collective
    def adapter(self) -> Adapter | None:
        """The policy's LoRA adapter (``train_model.lora.sync=adapter``: what an engine loads beside its base weights),
        as CPU tensors (on a CPU, the live ones: read them before the next update). Data-parallel: gathered from the
        shards on every rank in step, kept on rank 0 (None on the others)."""
        keep = self.parallel is None or self.parallel.rank == 0
        tensors = gathered(adapter_weights(self.policy), keep=keep)
        return Adapter(adapter_config(self.policy), tensors) if keep else None

    @collective
    def probe_log_probs(self, token_ids: list[int]) -> torch.Tensor:
        """The weight sync check's probe under the policy (:func:`probe_log_probs`)."""
        return probe_log_probs(self.policy, token_ids)

    @collective
    def save_pretrained(self, path, safe_serialization: bool = True) -> None:
        """What a checkpoint holds of the policy: HF format (the LoRA adapter with LoRA), and an actor-critic
        run's value model in ``path/critic``. Data-parallel: the weights gathered whole from the shards and
        written by rank 0, and the optimizer state as the ranks hold it, each rank its shards, in
        ``path/optimizer_shards`` (``path/critic/optimizer_shards`` for the critic's; a folder every rank can
        write)."""
        self._save_model(self.policy, self.optimizer, Path(path), safe_serialization)
        if self.critic is not None:
            self._save_model(self.critic.model, self.critic.optimizer, Path(path) / CRITIC_DIR, safe_serialization)

    def _save_model(self, model, optimizer, path: Path, safe_serialization: bool) -> None:
        if self.parallel is None:
            model.save_pretrained(path, safe_serialization=safe_serialization)
            return
        state = gathered(((name, t.detach()) for name, t in model.state_dict().items()), keep=self.parallel.rank == 0)
        if self.parallel.rank == 0:
            model.save_pretrained(path, state_dict=state, safe_serialization=safe_serialization)
        save_optimizer(model, optimizer, path / OPTIMIZER_SHARDS)

    def state_dict(self) -> dict:
        """The optimizers and the micro-batch shuffle: what a checkpoint needs besides the weights. Data-parallel:
        the world size instead of the optimizers, whose shards :meth:`save_pretrained` writes."""
        common = {Key.SHUFFLE_RNG: self.shuffle.get_state(), Key.SCHEDULER: _state(self.scheduler)}
        if self.critic is not None:
            common[Key.CRITIC_SCHEDULER] = _state(self.critic.scheduler)
            common[Key.CRITIC_OPTIMIZER] = None if self.parallel else self.critic.optimizer.state_dict()
        if self.parallel is None:
            return {Key.OPTIMIZER: self.optimizer.state_dict(), **common}
        return {Key.OPTIMIZER: None, Key.WORLD_SIZE: self.parallel.world_size, **common}

    @collective
    def load_state_dict(self, state: dict, checkpoint_dir=None) -> None:
        """:meth:`state_dict` back; data-parallel: on every rank, with the optimizers' shards read from
        ``checkpoint_dir`` (the same world size: :class:`torchrl_grpo.run.state.RunState` checks it). A checkpoint
        without a critic's state (a run without one) leaves the critic's optimizer fresh."""
        if self.parallel is None:
            self.optimizer.load_state_dict(state[Key.OPTIMIZER])
        else:
            load_optimizer(self.policy, self.optimizer, Path(checkpoint_dir) / OPTIMIZER_SHARDS)
        self.shuffle.set_state(state[Key.SHUFFLE_RNG])
        _load_state(self.scheduler, state.get(Key.SCHEDULER))  # older checkpoints have none
        if self.critic is not None and Key.CRITIC_SCHEDULER in state:
            if self.parallel is None:
                self.critic.optimizer.load_state_dict(state[Key.CRITIC_OPTIMIZER])
            else:
                load_optimizer(self.critic.model, self.critic.optimizer,
                               Path(checkpoint_dir) / CRITIC_DIR / OPTIMIZER_SHARDS)
            _load_state(self.critic.scheduler, state[Key.CRITIC_SCHEDULER])


def _state(scheduler) -> dict | None:
    return None if scheduler is None else scheduler.state_dict()


def _load_state(scheduler, state: dict | None) -> None:
    if scheduler is not None and state is not None:
        scheduler.load_state_dict(state)


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
