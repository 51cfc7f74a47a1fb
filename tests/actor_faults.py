"""Faults injected into Ray rollout actors through Ray's own seam, its worker setup hook
(``+ray.init.runtime_env.worker_process_setup_hook=actor_faults.<hook>``, with this folder on PYTHONPATH): it
runs in each new actor process before the actor is built, so the production code carries no test flag."""
import os
import time

EXIT_AT = 3  # each incarnation of an actor meets its fault at the start of this collect (1-based)


def _at_third_collect(fault) -> None:
    """Every rollout actor in this process meets ``fault()`` at the start of its third collect (and of each after)."""
    from torchrl_grpo.collect.rollout_actors import RolloutActor

    collect = RolloutActor.collect

    def faulty_collect(self):
        self.fault_calls = getattr(self, "fault_calls", 0) + 1
        if self.fault_calls >= EXIT_AT:
            fault()
        return collect(self)

    RolloutActor.collect = faulty_collect


def exit_at_third_collect() -> None:
    """Every rollout actor in this process calls ``os._exit(1)`` at the start of its third collect: it dies like
    a crashed worker, with no exception and no cleanup."""
    _at_third_collect(lambda: os._exit(1))


def stall_at_third_collect() -> None:
    """Every rollout actor in this process stops answering at the start of its third collect (a hung GPU, a
    deadlock): it sleeps without returning, alive."""
    def stall():
        while True:
            time.sleep(60)

    _at_third_collect(stall)
