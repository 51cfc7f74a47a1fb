"""Faults injected into Ray rollout actors through Ray's own seam, its worker setup hook
(``+ray.init.runtime_env.worker_process_setup_hook=actor_faults.<hook>``, with this folder on PYTHONPATH): it
runs in each new actor process before the actor is built, so the production code carries no test flag."""
import os

EXIT_AT = 3  # each incarnation of an actor dies at the start of this collect (1-based)


def exit_at_third_collect() -> None:
    """Every rollout actor in this process calls ``os._exit(1)`` at the start of its third collect: it dies like
    a crashed worker, with no exception and no cleanup."""
    from torchrl_grpo.collect.rollout_actors import RolloutActor

    collect = RolloutActor.collect

    def dying_collect(self):
        self.fault_calls = getattr(self, "fault_calls", 0) + 1
        if self.fault_calls >= EXIT_AT:
            os._exit(1)
        return collect(self)

    RolloutActor.collect = dying_collect


def stall_at_third_collect() -> None:
    """Every rollout actor in this process stops answering at the start of its third collect (a hung GPU, a
    deadlock): it sleeps without returning, alive."""
    import time

    from torchrl_grpo.collect.rollout_actors import RolloutActor

    collect = RolloutActor.collect

    def stalled_collect(self):
        self.fault_calls = getattr(self, "fault_calls", 0) + 1
        while self.fault_calls >= EXIT_AT:
            time.sleep(60)
        return collect(self)

    RolloutActor.collect = stalled_collect
