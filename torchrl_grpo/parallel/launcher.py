"""Starting data-parallel ranks: this process becomes rank 0 and starts the followers (or joins the ranks
``torchrun`` started), and each follower builds what rank 0 has and follows its calls
(:meth:`torchrl_grpo.parallel.ranks.DataParallel.follow`). What a follower builds is the composition root's
(``build_follower``: a module-level function, so that a spawned process can be handed it)."""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from torchrl_grpo.config.placement import torchrun_launch
from torchrl_grpo.config.spec import RunSpec
from torchrl_grpo.core.errors import RunError, one_line
from torchrl_grpo.parallel.ranks import DataParallel, process_group

# (run spec, this rank's DataParallel) -> (trainer, engine) that follow rank 0's
BuildFollower = Callable[[RunSpec, DataParallel], tuple]

# what torchrun's followers wait for rank 0 (they join before its config reaches them); train.rank_timeout_s's
# default
RANK_TIMEOUT_S = 1800


@contextlib.contextmanager
def data_parallel_ranks(spec: RunSpec, run_dir: Path, build_follower: BuildFollower):
    """``train.strategy=fsdp`` (or ``auto`` resolved to it): this process becomes rank 0 of ``train_model.num_devices``
    ranks and starts the others (:func:`follow_rank` with ``build_follower``), or of the ranks ``torchrun`` started
    (:func:`torchrun_follower` runs the others); yields rank 0's :class:`DataParallel` (None for the other strategies).
    The config was checked and resolved into ``spec`` first (torchrun's world taken as ``train_model.num_devices``:
    :func:`~torchrl_grpo.config.placement.adopt_torchrun_ranks`), so a bad one fails in one line before any rank
    starts; the followers get it. The followers stop when rank 0's run ends; those it started are killed if it
    fails. A follower that dies or stalls stops the run in one line (its collective fails at once, or after
    ``train.rank_timeout_s``), saying how to resume from ``run_dir``'s last checkpoint."""
    launch = torchrun_launch()
    if spec.placement.strategy != "fsdp":
        yield None
        return
    # rank 0's vLLM engine in a fresh process of its own (build_sync asks for engine_process=own, spawned): in
    # this one (or a fork of it) it would take the ranks' process group and wait for the followers
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    world, store, init_method, followers = spec.placement.ranks, None, "env://", []
    timeout_s = spec.train.rank_timeout_s
    if launch is None:
        store = Path(tempfile.mkdtemp(prefix="grpo_ranks_"))
        init_method = f"file://{store / 'store'}"
        spawn = multiprocessing.get_context("spawn")
        followers = [spawn.Process(target=follow_rank, args=(rank, world, init_method, build_follower, timeout_s),
                                   daemon=True) for rank in range(1, world)]
    for follower in followers:
        follower.start()
    try:
        with process_group(0, world, init_method, timeout_s, followed=True) as parallel:
            parallel.broadcast_run(spec)
            started = ", started by torchrun" if launch is not None else ""
            print(f"data-parallel training: {world} rank{'s' if world > 1 else ''} (FSDP2 over "
                  f"{torch.distributed.get_backend()}{started}), this process is rank 0", flush=True)
            try:
                yield parallel
            except BaseException as err:
                failure = _follower_failure(err, followers, launch is not None, run_dir, timeout_s)
                if failure is not None:
                    raise failure from None
                raise
            parallel.announce(None)
    finally:
        for follower in followers:
            follower.join(timeout=60)
            if follower.is_alive():
                follower.kill()
                follower.join()
        if store is not None:
            shutil.rmtree(store, ignore_errors=True)


def _follower_failure(err: BaseException, followers: list, torchrun: bool, run_dir: Path,
                      timeout_s: float) -> RunError | None:
    """Rank 0's run failed with ``err``: the followers killed (they may wait in a collective this rank will not
    reach), and the one-line error when a failed collective was a follower's doing (one died, or stalled past
    ``timeout_s``); None when the error is rank 0's own."""
    collective = isinstance(err, RuntimeError)
    if collective:  # a collective failed: did a follower die?
        for follower in followers:
            follower.join(timeout=5)
    dead = [f"rank {r} (exit code {f.exitcode})" for r, f in enumerate(followers, 1) if f.exitcode]
    if torchrun and collective:
        dead = ["a rank"]  # torchrun's: it reports which, and stops the others
    for follower in followers:
        follower.kill()
    resume = f"the last checkpoint continues with train.resume=auto hydra.run.dir={run_dir}"
    if dead and collective:
        return RunError(f"data-parallel {', '.join(dead)} stopped (its output is above): "
                        f"{str(err).splitlines()[0][:300]}; {resume}")
    if collective and "timed out" in str(err).lower():  # alive, not answering
        return RunError(f"data-parallel: a rank did not answer within train.rank_timeout_s={timeout_s:g} s (stalled, "
                        f"or rank 0's own work took longer: raise the key; {one_line(err)[:200]}); {resume}")
    return None


def torchrun_follower(build_follower: BuildFollower) -> bool:
    """Under ``torchrun``, a rank other than 0 follows rank 0 (:func:`follow_rank`) instead of running the
    script, and this returns True once the run ended; False for rank 0 and plain processes."""
    launch = torchrun_launch()
    if launch is None or launch.rank == 0:
        return False
    follow_rank(launch.rank, launch.world_size, "env://", build_follower)
    return True


def follow_rank(rank: int, world: int, init_method: str, build_follower: BuildFollower,
                timeout_s: float = RANK_TIMEOUT_S) -> None:
    """A follower rank (started by :func:`data_parallel_ranks` or torchrun): ``build_follower`` builds the trainer
    and engine rank 0 has, from the run spec rank 0 sends, sharded alike; they then make the calls rank 0's
    trainer announces until the run ends. SIGINT and SIGTERM are rank 0's to act on: a terminal's Ctrl-C and a
    scheduler's preemption signal every process of the job, and rank 0 then finishes the step and saves a
    checkpoint, which needs this rank alive (it is stopped as rank 0 stops, or killed if rank 0 dies). Until rank 0's
    run spec arrives there is nothing to save, and a SIGTERM ends this rank at once: torchrun's, when rank 0 refused
    its config, would otherwise wait out torchrun's 30 s grace and a SIGKILL. ``timeout_s``: ``train.rank_timeout_s``
    (torchrun's followers join before rank 0's config reaches them: ``RANK_TIMEOUT_S``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with process_group(rank, world, init_method, timeout_s, followed=True) as parallel:
        spec = parallel.broadcast_run(None)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        parallel.follow(*build_follower(spec, parallel))
