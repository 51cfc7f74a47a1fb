"""Where a run stands: everything a checkpoint saves, and everything a resume restores, here only.

Saved (:meth:`RunState.save`): the policy in HF format (the adapter with LoRA) and an actor-critic run's value
model, the optimizers (data-parallel: each rank's shards) and schedules, the micro-batch shuffle, the step, the data
position (a prompt sampler, or the async loop's :class:`AsyncProgress`), the global RNG states, the engine's sampling
state and the config. ``trainer_state.pt``'s keys are :class:`~torchrl_grpo.core.checkpoint.Key`; the files and their
atomic write are :mod:`torchrl_grpo.core.checkpoint`'s.

Restored, in the order a run starts: the models' weights as the builder loads them (:meth:`RunState.policy_folder`,
:meth:`RunState.restore_adapter`, :meth:`RunState.critic_folder`: read from the checkpoint, not loaded twice), the
trainer's state, the data position and the RNGs when the loop starts (:meth:`RunState.restore`), then the
checkpoint's weights pushed to the engines, which start from the base model (:meth:`RunState.resume_engines`).

What resumes exactly: a sync run (``train.sync_iter=true``) gives, step for step, the metrics of the
uninterrupted run, its engine in this process or its own. Not exactly: with ``train.sync_iter=false`` the
batch prefetched at save time is sampled again with the checkpoint's weights; the async loop's actors are
reseeded with the step, and the batches in flight in the actors are drawn again.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torchrl_grpo.config.settings import CheckpointSettings
from torchrl_grpo.config.spec import RunSpec
from torchrl_grpo.core import checkpoint
from torchrl_grpo.core.checkpoint import CRITIC_DIR, OPTIMIZER_SHARDS, Key
from torchrl_grpo.core.errors import ConfigError, RunError
from torchrl_grpo.core.secrets import masker
from torchrl_grpo.models.adapter import WEIGHTS_FILE
from torchrl_grpo.parallel.ranks import collective, gathered, load_optimizer, save_optimizer
from torchrl_grpo.training.trainer import Trainer


class RunState:
    """The checkpoint to resume from (read once, at start) and the saving of new ones."""

    def __init__(self, spec: RunSpec, run_dir: Path):
        settings = spec.checkpoint
        self.run_dir, self.config = run_dir, spec.config
        self.directory = run_dir / settings.directory
        self.frequency, self.keep = settings.frequency, settings.keep
        self.resume_from = checkpoint.find_resume_point(settings.resume, self.directory)
        self._saved = checkpoint.load_state(self.resume_from) if self.resume_from is not None else None
        if self._saved is not None:
            check_world_size(settings, self._saved, self.resume_from)
        self.step = int(self._saved[Key.STEP]) if self._saved is not None else 0  # the last finished step

    @property
    def resuming(self) -> bool:
        return self.resume_from is not None

    def policy_folder(self, model_path: str, lora: bool) -> str:
        """Where the policy's weights load from: the checkpoint when it holds the whole model, else ``model_path``
        (a LoRA run's checkpoint holds only the adapter: :meth:`restore_adapter` puts it back after the base loads)."""
        return str(self.resume_from) if self.resuming and not lora else model_path

    def restore_adapter(self, policy) -> None:
        """A resumed LoRA run's adapter weights into ``policy`` (a PEFT model over the base); a fresh run keeps its
        own."""
        if not self.resuming:
            return
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(policy, load_file(str(self.resume_from / WEIGHTS_FILE)))

    def critic_folder(self) -> Path | None:
        """The value model's folder in the checkpoint, when resuming an actor-critic run (None: build a fresh one)."""
        saved = None if self.resume_from is None else self.resume_from / checkpoint.CRITIC_DIR
        return saved if saved is not None and saved.is_dir() else None

    def restore(self, trainer, data, engine=None) -> None:
        """Continue where the checkpoint left off: the trainer's state, ``data``'s position (anything with
        ``load_state_dict``), the global RNGs and, when both the checkpoint and ``engine`` have one, the
        engine's sampling state (then the run samples exactly what it would have without the interruption).
        A fresh run has nothing to restore."""
        if self._saved is None:
            return
        TrainerState(trainer).load_state_dict(self._saved, self.resume_from)
        data.load_state_dict(self._saved[Key.SAMPLER])
        checkpoint.set_rng_state(self._saved[Key.RNG])
        if engine is not None and self._saved.get(Key.ENGINE_RNG) is not None:
            engine.load_sampling_state(self._saved[Key.ENGINE_RNG])
        print(f"resumed from {self.resume_from} (step {self.step})", flush=True)

    def resume_engines(self, weights) -> None:
        """The engines start from the base weights: a resumed run gives them the checkpoint's (``weights``: the run's
        :class:`~torchrl_grpo.training.weight_sync.WeightSync`) before their first generation."""
        if self.resuming:
            weights.resume()

    def due(self, step: int, total_steps: int) -> bool:
        """A checkpoint every ``logging.checkpoint_frequency`` steps (0: never) and after the last step."""
        return step == total_steps or (self.frequency > 0 and step % self.frequency == 0)

    def save(self, step: int, trainer, tokenizer, data, engine=None) -> Path:
        """Checkpoint ``step`` atomically: the policy, the tokenizer and the state above (``data``: anything
        with ``state_dict``; ``engine``: an engine whose sampling state to keep, when nothing samples from it
        meanwhile)."""
        self.step = step
        saved = TrainerState(trainer)
        state = {Key.STEP: step, **saved.state_dict(), Key.SAMPLER: data.state_dict(),
                 Key.RNG: checkpoint.rng_state(),
                 Key.ENGINE_RNG: engine.sampling_state() if engine is not None else None,
                 Key.CONFIG: masker().tree(self.config)}
        weights = sum(p.numel() * p.element_size() for p in trainer.policy.parameters())
        return checkpoint.save(self.directory, step, saved, tokenizer, state, keep=self.keep, weights_bytes=weights)

    def after_step(self, step: int, total_steps: int, trainer, tokenizer, data, stop_requested: Callable[[], bool],
                   engine=None, fault: str | None = None) -> str | None:
        """Checkpoint when due, when a stop was asked (SIGINT/SIGTERM), when training diverged or when ``fault``
        says why the run cannot go on (both then raise a :class:`RunError`). Returns the line to print when the
        run stops here as asked, else None. ``stop_requested`` is asked again after a checkpoint: a signal that
        came while it was written stops the run on it, not after one more step."""
        diverged, saved = fault or trainer.divergence(), None
        if self.due(step, total_steps) or stop_requested() or diverged:
            saved = self.save(step, trainer, tokenizer, data, engine)
        if diverged:
            raise RunError(f"{diverged}; stopped (checkpoint of step {step} saved in {saved.parent})")
        if stop_requested():
            if saved is None:  # the signal came after the first look
                self.save(step, trainer, tokenizer, data, engine)
            return f"stopped after step {step} (checkpoint saved); {self.continue_hint()}"
        return None

    def stopped_early(self, last_step: int, start_step: int, trainer, tokenizer, data) -> str:
        """A stop asked for (SIGINT/SIGTERM) that also ended the engine's or the actors' processes, so that the
        step under way cannot finish: a checkpoint of ``last_step`` (the last one the trainer holds; ``data`` its
        data position) when this run finished any; the line to print."""
        if last_step <= start_step:
            return f"stopped before any step of this run finished (nothing new to save); {self.continue_hint()}"
        self.save(last_step, trainer, tokenizer, data)
        return (f"stopped after step {last_step} (checkpoint saved; the stop also ended the engine's processes); "
                f"{self.continue_hint()}")

    def stopped_by(self, cause, last_step: int, start_step: int, trainer, tokenizer, data) -> RunError:
        """The one-line error for a run that cannot go on after ``last_step`` (a failed actor, a reward function
        that raised): a checkpoint of that step first, when this run finished any; ``data`` is its position."""
        where = "no step finished in this run, nothing new to save"
        if last_step > start_step:
            where = f"checkpoint of step {last_step} saved in {self.save(last_step, trainer, tokenizer, data).parent}"
        return RunError(f"{cause}; stopped ({where}; {self.continue_hint()})")

    def continue_hint(self) -> str:
        return f"continue with train.resume=auto hydra.run.dir={self.run_dir}"


def check_world_size(settings: CheckpointSettings, saved: dict, resume_from: Path) -> None:
    """A checkpoint resumes with the data-parallel ranks that wrote it (its optimizer state is in their shards;
    a one-process one holds it whole): else a one-line ConfigError, before anything heavy starts."""
    written, ranks = int(saved.get(Key.WORLD_SIZE, 1)), settings.ranks
    if written != ranks:
        raise ConfigError(f"train.resume={settings.resume}: {resume_from} was trained by {_ranks(written)} and "
                          f"this run has {_ranks(ranks)}; resume with train_model.num_devices={written}"
                          f"{' train.strategy=fsdp' if written > 1 else ''}, or start a new run from its weights "
                          f"with model.name={resume_from}")


def _ranks(n: int) -> str:
    return f"{n} data-parallel ranks (train.strategy=fsdp)" if n > 1 else "one process"


class TrainerState:
    """What a checkpoint keeps of a :class:`~torchrl_grpo.training.trainer.Trainer`: the policy in HF format (the LoRA
    adapter with LoRA) and an actor-critic run's value model in ``critic/``, the optimizers and schedules, the
    micro-batch shuffle. Data-parallel, every rank takes part in :meth:`save_pretrained` and :meth:`load_state_dict`
    (:func:`~torchrl_grpo.parallel.ranks.collective`)."""

    def __init__(self, trainer: Trainer):
        self.trainer, self.parallel = trainer, trainer.parallel

    @collective
    def save_pretrained(self, path, safe_serialization: bool = True) -> None:
        """The models into ``path`` (``checkpoint.save`` calls it as HF's): data-parallel, the weights gathered
        whole from the shards and written by rank 0, and the optimizer state as the ranks hold it, each rank its
        shards, in ``path/optimizer_shards`` (``path/critic/optimizer_shards`` for the critic's; a folder every rank
        can write)."""
        t = self.trainer
        self._save_model(t.policy, t.optimizer, Path(path), safe_serialization)
        if t.critic is not None:
            self._save_model(t.critic.model, t.critic.optimizer, Path(path) / CRITIC_DIR, safe_serialization)

    def _save_model(self, model, optimizer, path: Path, safe_serialization: bool) -> None:
        if self.parallel is None:
            model.save_pretrained(path, safe_serialization=safe_serialization)
            return
        state = gathered(((name, t.detach()) for name, t in model.state_dict().items()), keep=self.parallel.rank == 0)
        if self.parallel.rank == 0:
            model.save_pretrained(path, state_dict=state, safe_serialization=safe_serialization)
        save_optimizer(model, optimizer, path / OPTIMIZER_SHARDS)

    def state_dict(self) -> dict:
        """The optimizers, schedules and the micro-batch shuffle: what ``trainer_state.pt`` holds of the trainer.
        Data-parallel: the world size instead of the optimizers, whose shards :meth:`save_pretrained` writes."""
        t = self.trainer
        common = {Key.SHUFFLE_RNG: t.shuffle.get_state(), Key.SCHEDULER: _state(t.scheduler)}
        if t.critic is not None:
            common[Key.CRITIC_SCHEDULER] = _state(t.critic.scheduler)
            common[Key.CRITIC_OPTIMIZER] = None if self.parallel else t.critic.optimizer.state_dict()
        if self.parallel is None:
            return {Key.OPTIMIZER: t.optimizer.state_dict(), **common}
        return {Key.OPTIMIZER: None, Key.WORLD_SIZE: self.parallel.world_size, **common}

    @collective
    def load_state_dict(self, state: dict, checkpoint_dir=None) -> None:
        """:meth:`state_dict` back; data-parallel: on every rank, with the optimizers' shards read from
        ``checkpoint_dir`` (the same world size: :func:`check_world_size`). A checkpoint without a critic's state
        (a run without one) leaves the critic's optimizer fresh."""
        t = self.trainer
        if self.parallel is None:
            t.optimizer.load_state_dict(state[Key.OPTIMIZER])
        else:
            load_optimizer(t.policy, t.optimizer, Path(checkpoint_dir) / OPTIMIZER_SHARDS)
        t.shuffle.set_state(state[Key.SHUFFLE_RNG])
        _load_state(t.scheduler, state.get(Key.SCHEDULER))  # older checkpoints have none
        if t.critic is not None and Key.CRITIC_SCHEDULER in state:
            if self.parallel is None:
                t.critic.optimizer.load_state_dict(state[Key.CRITIC_OPTIMIZER])
            else:
                load_optimizer(t.critic.model, t.critic.optimizer, Path(checkpoint_dir) / CRITIC_DIR / OPTIMIZER_SHARDS)
            _load_state(t.critic.scheduler, state[Key.CRITIC_SCHEDULER])


def _state(scheduler) -> dict | None:
    return None if scheduler is None else scheduler.state_dict()


def _load_state(scheduler, state: dict | None) -> None:
    if scheduler is not None and state is not None:
        scheduler.load_state_dict(state)


class AsyncProgress:
    """The async loop's data position and counters: each actor's prompt-sampler state as of the last batch
    the trainer received from it (taken or dropped; the prompts of batches in flight are drawn again after a
    resume), the policy version, and the staleness counters."""

    def __init__(self, num_actors: int):
        self.actor_samplers: list[dict | None] = [None] * num_actors
        self.policy_version = 0
        self.stale_dropped = 0
        self.staleness_max = 0

    def state_dict(self) -> dict:
        return {"actor_samplers": list(self.actor_samplers), "policy_version": self.policy_version,
                "stale_dropped": self.stale_dropped, "staleness_max": self.staleness_max}

    def load_state_dict(self, state: dict) -> None:
        if "actor_samplers" not in state:  # a sync checkpoint: its prompt position continues as actor 0's
            state = {"actor_samplers": [state]}
        saved = list(state["actor_samplers"])[: len(self.actor_samplers)]
        self.actor_samplers[: len(saved)] = saved
        self.policy_version = int(state.get("policy_version", 0))
        self.stale_dropped = int(state.get("stale_dropped", 0))
        self.staleness_max = int(state.get("staleness_max", 0))
