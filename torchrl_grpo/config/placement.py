"""Which devices the train, reference and inference models get.

With GPUs: explicit ``<role>.devices`` lists are taken as given (and must exist); otherwise each role takes
``<role>.num_devices`` GPUs, disjoint when enough exist, else all roles share the first GPUs (the engine
then keeps ``inference_model.gpu_memory_utilization`` of its device). Without GPUs everything runs on the
CPU; asking for GPUs there is an error, never a silent downgrade, except for train ranks with
``train.strategy=fsdp`` (:func:`train_strategy`): those are processes, gloo ranks on the CPU.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from omegaconf import DictConfig

from torchrl_grpo.core.errors import ConfigError

ROLES = ("train_model", "inference_model", "ref_model")


@dataclass(frozen=True)
class Placement:
    train: list[str]
    inference: list[str]
    ref: list[str]
    shared: bool
    strategy: str = "layer_split"  # train.strategy resolved (train_strategy): fsdp | layer_split
    ranks: int = 1                 # data-parallel training ranks (fsdp: train_model.num_devices), else 1
    actors: ActorGpus | None = None  # grpo-async.py's rollout actors (place_actors); None: a sync run

    def describe(self) -> str:
        note = " (roles share devices)" if self.shared else ""
        engines = (f"inference on {','.join(self.inference)}" if self.actors is None else self.actors.describe())
        return f"train on {','.join(self.train)}, {engines}, reference on {','.join(self.ref)}{note}"


def _check_cpu_only(cfg: DictConfig, roles: list[str], ranks: bool) -> None:
    """On a machine without GPUs: a role asking for GPUs is a one-line ConfigError (data-parallel ranks are gloo
    processes there)."""
    for role in roles:
        devices = cfg[role].get("devices")
        if devices:
            raise ConfigError(f"{role}.devices={list(devices)} but this machine has no GPU: "
                              f"set {role}.devices=null to run on the CPU")
        if cfg[role].get("num_devices", 1) > 1 and not (role == "train_model" and ranks):
            fix = " (or train.strategy=fsdp: gloo ranks)" if role == "train_model" else ""
            raise ConfigError(f"{role}.num_devices={cfg[role].num_devices} but this machine has no GPU: set "
                              f"{role}.num_devices=1 to run on the CPU{fix}")


def _asked_gpus(cfg: DictConfig, roles: list[str], ranks: bool, gpu_count: int) -> dict[str, list[int]]:
    """The GPU ids the roles name (``<role>.devices``), each checked to exist on this machine."""
    if ranks and cfg.train_model.get("devices"):
        raise ConfigError(f"train_model.devices={list(cfg.train_model.devices)} with train.strategy=fsdp: rank r "
                          "trains on GPU r of its machine (its LOCAL_RANK); set train_model.devices=null and pick the "
                          "GPUs with CUDA_VISIBLE_DEVICES")
    chosen: dict[str, list[int]] = {}
    for role in roles:
        devices = cfg[role].get("devices")
        if devices:
            missing = [d for d in devices if not 0 <= int(d) < gpu_count]
            if missing:
                raise ConfigError(f"{role}.devices={list(devices)}: GPU(s) {missing} do not exist "
                                  f"(this machine has {gpu_count}: 0..{gpu_count - 1})")
            chosen[role] = [int(d) for d in devices]
    return chosen


def place(cfg: DictConfig, needs_ref: bool, gpu_count: int) -> Placement:
    """Assign devices to the roles of ``cfg`` on a machine with ``gpu_count`` GPUs."""
    strategy = train_strategy(cfg)
    ranks = strategy == "fsdp"
    world = int(cfg.train_model.num_devices) if ranks else 1
    # data-parallel ranks shard the reference like the policy, on their own devices
    roles = [r for r in ROLES if r != "ref_model" or (needs_ref and not ranks)]
    if ranks and needs_ref:
        _check_ref_follows_ranks(cfg)
    if gpu_count == 0:
        _check_cpu_only(cfg, roles, ranks)
        return Placement(["cpu"], ["cpu"], ["cpu"], shared=True, strategy=strategy, ranks=world)
    chosen = _asked_gpus(cfg, roles, ranks, gpu_count)
    wanted = {r: int(cfg[r].get("num_devices", 1)) for r in roles if r not in chosen}
    if ranks:  # the ranks on this machine, each on the GPU of its local rank: 0, 1, ...
        launch, local = torchrun_launch(), wanted.pop("train_model")
        local = launch.local_world_size if launch is not None else local
        if local > gpu_count:
            raise ConfigError(f"{local} data-parallel ranks on this machine (train_model.num_devices, or torchrun's "
                              f"--nproc-per-node) but it has {gpu_count} GPU(s): start at most {gpu_count} here")
        chosen["train_model"] = list(range(local))
    for role, n in wanted.items():
        if n < 1 or n > gpu_count:
            raise ConfigError(f"{role}.num_devices={n} but this machine has {gpu_count} GPU(s): "
                              f"set {role}.num_devices between 1 and {gpu_count}")
    taken = {d for devs in chosen.values() for d in devs}
    free = [d for d in range(gpu_count) if d not in taken]
    if sum(wanted.values()) <= len(free):
        for role, n in wanted.items():
            chosen[role], free = free[:n], free[n:]
    else:
        for role, n in wanted.items():
            chosen[role] = list(range(n))
    as_names = {r: [f"cuda:{d}" for d in chosen[r]] for r in roles}
    flat = [d for r in roles for d in chosen[r]]
    return Placement(
        train=as_names["train_model"],
        inference=as_names["inference_model"],
        ref=as_names.get("ref_model", as_names["train_model"]),
        shared=len(flat) != len(set(flat)),
        strategy=strategy,
        ranks=world,
    )


@dataclass(frozen=True)
class ActorGpus:
    """Where ``grpo-async.py``'s rollout actors' engines run (:func:`place_actors`), in this machine's GPU numbering."""

    per_actor: float                   # ray.actor_num_gpus resolved: 0 (the CPU), a share of one GPU, or whole GPUs
    ray_gpus: tuple[int, ...] | None   # the GPUs a local Ray may hand to actors (None: a Ray cluster's own)
    engines: tuple[tuple[str, ...], ...]  # each actor's engine devices, as Ray would pack them (a cluster: "cuda")
    shares_training: bool              # an actor may land on a GPU the trainer or the reference uses

    @property
    def devices(self) -> list[str]:
        """Every device an actor's engine may run on."""
        return list(dict.fromkeys(d for engine in self.engines for d in engine))

    @property
    def memory_share(self) -> float:
        """What each engine's ``inference_model.gpu_memory_utilization`` is scaled by: its share of its GPU."""
        return min(1.0, self.per_actor) if self.per_actor > 0 else 1.0

    def describe(self) -> str:
        if self.per_actor == 0:
            return "rollout actors on the CPU"
        where = "a Ray cluster's GPUs" if self.ray_gpus is None else ",".join(f"cuda:{d}" for d in self.ray_gpus)
        note = ", beside training" if self.shares_training else ""
        return f"rollout actors on {where} ({self.per_actor:g} GPU each{note})"


def _actors_per_gpu(per_actor: float) -> int:
    return math.floor(1 / per_actor + 1e-9) if per_actor < 1 else 1


def _pack(gpus: list[int], per_actor: float, actors: int) -> list[tuple[str, ...]] | None:
    """Each actor's GPUs when ``actors`` engines of ``per_actor`` GPUs are packed onto ``gpus`` in order (shares of one
    GPU fill it before the next; whole GPUs are taken in runs), or None where they do not fit."""
    if per_actor < 1:
        per = _actors_per_gpu(per_actor)
        if actors > len(gpus) * per:
            return None
        return [(f"cuda:{gpus[i // per]}",) for i in range(actors)]
    width = int(per_actor)
    if actors * width > len(gpus):
        return None
    return [tuple(f"cuda:{d}" for d in gpus[i * width:(i + 1) * width]) for i in range(actors)]


def place_actors(cfg: DictConfig, placement: Placement, available: int) -> ActorGpus:
    """The rollout actors' GPUs on a machine with ``available`` GPUs, the trainer and reference on ``placement``'s.

    ``ray.actor_num_gpus=auto``: none without GPUs; one each where enough GPUs are free of training; else a share
    (1/``ray.num_actors``) of one beside training. A local Ray is given the GPUs free of training when the actors fit
    on them, else every GPU (the actors then may share the trainer's: pushes take the object store, never NCCL, which
    cannot put both ends of a transfer on one GPU); actors that fit nowhere are refused in one line, as are GPUs asked
    for on a machine without any. A Ray cluster (``ray.address``) places its actors itself."""
    ray, actors = cfg.ray, int(cfg.ray.num_actors)
    local = ray.get("address") is None
    training = sorted({int(d.split(":")[1]) for d in (*placement.train, *placement.ref) if d.startswith("cuda")})
    free = [d for d in range(available) if d not in training]
    asked = ray.actor_num_gpus
    if asked == "auto":
        per_actor = 0.0 if available == 0 else 1.0 if len(free) >= actors else 1 / actors
    else:
        per_actor = float(asked)
    if per_actor == 0:
        return ActorGpus(0.0, (), (("cpu",),) * actors, False)
    if not local:
        width = max(1, int(per_actor))
        return ActorGpus(per_actor, None, (("cuda",) * width,) * actors, False)
    if available == 0:
        raise ConfigError(f"ray.actor_num_gpus={asked} but this machine has no GPU for a local Ray to give its actors: "
                          "set ray.actor_num_gpus=0 (or auto), or join a Ray cluster with GPUs (ray.address)")
    engines = _pack(free, per_actor, actors)
    if engines is not None:
        return ActorGpus(per_actor, tuple(free), tuple(engines), False)
    if per_actor <= 1:
        everyone = training + free  # as the plan counts it: the trainer's GPU filled first
        engines = _pack(everyone, per_actor, actors)
        if engines is not None:
            return ActorGpus(per_actor, tuple(range(available)), tuple(engines), True)
    need = math.ceil(actors / _actors_per_gpu(per_actor)) if per_actor < 1 else actors * int(per_actor)
    share = f"; a share such as ray.actor_num_gpus={1 / actors:.3g} puts them all beside training" if actors > 1 else ""
    raise ConfigError(f"ray.num_actors={actors} x ray.actor_num_gpus={asked}: the actors need {need} GPU(s) but this "
                      f"machine has {available}, {len(free)} of them free of training; use fewer actors{share}")


def _check_ref_follows_ranks(cfg: DictConfig) -> None:
    """Under ``train.strategy=fsdp`` each rank holds its shard of the reference beside its shard of the policy: a
    reference placed elsewhere (``ref_model.devices``, ``ref_model.num_devices``) is refused, not dropped."""
    ref = cfg.ref_model
    asked = (f"ref_model.devices={list(ref.devices)}" if ref.get("devices") else
             f"ref_model.num_devices={ref.num_devices}" if int(ref.get("num_devices", 1)) != 1 else None)
    if asked:
        raise ConfigError(f"{asked} with train.strategy=fsdp: each data-parallel rank holds its shard of the reference "
                          "on its own device, beside the policy's; set ref_model.devices=null and "
                          "ref_model.num_devices=1 (or train.strategy=layer_split to place it yourself)")


def train_strategy(cfg: DictConfig) -> str:
    """``train.strategy`` resolved: ``auto`` is ``fsdp`` under ``torchrun`` (the ranks it started) and for
    several train devices (``train_model.num_devices`` data-parallel ranks: nccl on GPUs, gloo without), else
    ``layer_split``: one device (one process, no ranks), or GPUs named in ``train_model.devices`` (the layers split
    over those, in one process)."""
    chosen = cfg.get("train", {}).get("strategy", "auto")
    if chosen != "auto":
        return chosen
    if torchrun_launch() is not None:
        return "fsdp"
    several = int(cfg.train_model.get("num_devices", 1)) > 1 and not cfg.train_model.get("devices")
    return "fsdp" if several else "layer_split"


@dataclass(frozen=True)
class Launch:
    """The ranks a launcher started (``torchrun``: its ``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` and
    rendezvous variables)."""

    rank: int
    world_size: int
    local_world_size: int  # the ranks on this machine (on GPUs: GPUs 0..local_world_size-1 train)


def torchrun_launch(environ=os.environ) -> Launch | None:
    """This process's rank when ``torchrun`` (or a launcher setting the same variables) started several
    ranks; ``None`` for a plain process or a world of one. The ranks then join with ``init_method="env://"``."""
    if not all(key in environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    world = int(environ["WORLD_SIZE"])
    local = int(environ.get("LOCAL_WORLD_SIZE", world))
    return Launch(int(environ["RANK"]), world, local) if world > 1 else None


def adopt_torchrun_ranks(cfg: DictConfig, launch: Launch) -> None:
    """Under ``torchrun`` the ranks are its: ``train_model.num_devices`` becomes its world size (left at 1 or
    set to it; anything else is a one-line error), and they train data-parallel (``train.strategy`` fsdp or
    auto)."""
    given, strategy = int(cfg.train_model.num_devices), cfg.train.strategy
    if given not in (1, launch.world_size):
        raise ConfigError(f"train_model.num_devices={given} but torchrun started {launch.world_size} ranks: leave "
                          f"train_model.num_devices out (torchrun's ranks are the train devices) or set it to "
                          f"{launch.world_size}")
    if strategy == "layer_split":
        raise ConfigError(f"train.strategy=layer_split under torchrun ({launch.world_size} ranks): the layer split is "
                          "one process; use train.strategy=fsdp (or auto), or run python grpo.py without torchrun")
    cfg.train_model.num_devices = launch.world_size
