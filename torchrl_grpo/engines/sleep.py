"""vLLM's sleep mode, for an engine that shares a GPU with the trainer (``inference_model.sleep``).

While the trainer trains, the engine releases its KV cache and, at level 1, moves its weights to the CPU (level 2:
drops them, since the next push replaces them anyway). Before it samples again it wakes in the order that keeps the
peak low: the weights first, then the push into them, then the KV cache; the trainer's memory is free again by then.
vLLM discards the KV cache's contents when it sleeps: its prefix cache is reset first.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

TAGS = ("weights", "kv_cache")  # what vLLM's wake_up can bring back, in the order it is brought back


class Sleep:
    """The sleep state of one ``vllm.LLM`` made with ``enable_sleep_mode=True`` (``level`` 1 or 2; 0: never sleeps,
    every call here is then a no-op)."""

    def __init__(self, llm, level: int):
        self.llm, self.level = llm, level
        self.asleep: set[str] = set()
        self.weights_lost = False  # slept at level 2 and no push since: the engine has no weights to sample with

    def sleep(self) -> None:
        if not self.level or self.asleep:
            return
        self.llm.reset_prefix_cache()
        self.llm.sleep(level=self.level)
        self.asleep, self.weights_lost = set(TAGS), self.level == 2

    def wake(self, *tags: str) -> None:
        """Bring back what of ``tags`` sleeps, in :data:`TAGS`' order."""
        waking = [tag for tag in TAGS if tag in tags and tag in self.asleep]
        if waking:
            self.llm.wake_up(tags=waking)
            self.asleep -= set(waking)

    def for_generation(self) -> None:
        """Before the engine samples or scores: awake, with weights."""
        if self.weights_lost:
            raise RuntimeError("the vLLM engine slept at level 2 and dropped its weights: push weights before it "
                               "generates (inference_model.sleep=1 keeps them)")
        self.wake(*TAGS)

    @contextlib.contextmanager
    def for_push(self) -> Iterator[None]:
        """Around a push: the weights woken before it, the KV cache only after it."""
        self.wake("weights")
        yield
        self.weights_lost = False
        self.wake("kv_cache")
