"""Playing episodes: G completions per prompt, each an :class:`~torchrl_grpo.episodes.episode.Episode` of one or
more engine turns, with what the environment inserts between them, scored at the end."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from tensordict import NonTensorData, TensorDict

from torchrl_grpo.episodes.episode import Episode
from torchrl_grpo.episodes.task_env import episode_state, make_env, messages_of
from torchrl_grpo.episodes.trajectories import prompt_token_ids
from torchrl_grpo.episodes.turn_envs import Turns

ENDINGS = ("answer", "max_steps", "length", "context")  # why an episode ended: see Played


@dataclass
class Played:
    """An episode played out: its ids (:class:`Episode`), the conversation as messages (the assistant's turns as
    the engine's text), how its last engine turn finished ("stop" or "length"), why it ended ("answer": nothing
    answered its last turn, "length": the same after a turn cut at max_tokens, "max_steps", "context": the next
    turn would not fit max_model_len), the environment's counts (e.g. tool calls) and its reward components."""

    episode: Episode
    prompt_length: int
    conversation: list[dict]
    finish_reason: str = "stop"
    ended: str = "answer"
    counts: dict[str, int] = field(default_factory=dict)
    components: dict[str, float] = field(default_factory=dict)
    versions: list[int] | None = None  # streamed: the policy version that sampled each completion token

    @property
    def text(self) -> str:
        """The assistant's last turn: what the rewards judge by default."""
        return next(m["content"] for m in reversed(self.conversation) if m["role"] == "assistant")


def play(engine, tokenizer, task, rows: list[dict], *, n: int, max_tokens: int, temperature: float, top_p: float,
         max_model_len: int | None, turns: Turns = Turns(), envs: list | None = None, top_k: int = 0,
         min_p: float = 0.0) -> tuple[list[Played], float]:
    """``n`` episodes of each row (prompt-major, as ``Engine.generate``) and the seconds spent in the engine.

    A single-turn episode (``turns.single``: one turn, no ``env.transforms``) is one engine request per row, scored
    by the task's rewards. Otherwise each episode runs in its own TorchRL environment
    (:func:`torchrl_grpo.episodes.task_env.make_env`; ``envs``: ones to reuse, at least ``len(rows) * n``): the
    engine's turns go in as sampled ids and text, what the environment inserts between turns comes back as ids.
    The first turn of the ``n`` episodes of a row is one request (they share the prompt's cache); later turns are
    one request per episode still going."""
    if turns.single:
        return _play_single_turn(engine, tokenizer, task, rows, n=n, max_tokens=max_tokens, temperature=temperature,
                                 top_p=top_p, top_k=top_k, min_p=min_p)
    count, envs = len(rows) * n, [] if envs is None else envs
    envs.extend(make_env(task, turns, tokenizer, max_tokens=max_tokens, max_model_len=max_model_len)
                for _ in range(count - len(envs)))
    states = [env.reset(TensorDict({"row": NonTensorData(rows[i // n], batch_size=(1,))}, batch_size=(1,)))
              for i, env in enumerate(envs[:count])]
    played = []
    for state in states:
        prompt = state["tokens", "prompt"][0].tolist()
        played.append(Played(Episode.start(prompt), len(prompt), messages_of(state)))
    going, generating = list(range(count)), 0.0
    while going:
        started = time.perf_counter()
        if played[0].episode.turns == 0:  # the first turn
            prompts = [played[i * n].episode.tokens for i in range(len(rows))]
            completions = engine.generate(prompts, n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                          top_k=top_k, min_p=min_p)
        else:
            completions = engine.generate([played[i].episode.tokens for i in going], n=1, max_tokens=max_tokens,
                                          temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
        generating += time.perf_counter() - started
        still = []
        for i, c in zip(going, completions):
            p, state = played[i], states[i]
            state["tokens", "response"] = torch.tensor([list(c.token_ids)], dtype=torch.long)
            state["text", "response"] = NonTensorData(c.text, batch_size=(1,))
            state["finish_reason"] = NonTensorData(c.finish_reason, batch_size=(1,))
            after = envs[i].step(state)["next"]
            p.episode.add_sampled(list(c.token_ids), list(c.log_probs))
            p.episode.add_inserted(after["tokens", "prompt"][0, len(p.episode.tokens):].tolist())
            p.conversation, p.finish_reason = messages_of(after), c.finish_reason
            if bool(after["done"].any()):
                p.ended, p.counts = episode_state(after)
                p.components = {k: float(v) for k, v in after["rewards"].items()}
            else:
                states[i] = after
                still.append(i)
        going = still
    return played, generating


def _play_single_turn(engine, tokenizer, task, rows: list[dict], *, n: int, max_tokens: int, temperature: float,
                      top_p: float, top_k: int, min_p: float) -> tuple[list[Played], float]:
    """One engine turn per episode, no environment: what :class:`~torchrl_grpo.episodes.task_env.TaskEnv` gives
    for such an episode (the same prompt ids, conversation, ending and reward components), without it."""
    prompts = prompt_token_ids(task, tokenizer, rows)
    started = time.perf_counter()
    completions = engine.generate(prompts, n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                  top_k=top_k, min_p=min_p)
    generating = time.perf_counter() - started
    return scored_completions(task, [prompts[c.prompt_index] for c in completions],
                              [rows[c.prompt_index] for c in completions], completions), generating


def scored_completions(task, prompts: list[list[int]], rows: list[dict], completions: list,
                       versions: list[list[int]] | None = None) -> list[Played]:
    """Single-turn episodes: each completion (its ``token_ids``, ``log_probs``, ``finish_reason`` and ``text``) after
    its own prompt (``prompts[i]`` of row ``rows[i]``), scored by the task. ``versions``: each completion's tokens'
    policy versions, where they were streamed."""
    scores = task.score_batch([c.text for c in completions], rows, [c.token_ids for c in completions])
    played = []
    for i, (c, prompt, row, components) in enumerate(zip(completions, prompts, rows, scores)):
        episode = Episode.start(prompt)
        episode.add_sampled(list(c.token_ids), list(c.log_probs))
        ended = "max_steps" if c.finish_reason == "stop" else "length"
        played.append(Played(episode, len(prompt), [*task.messages(row), {"role": "assistant", "content": c.text}],
                             c.finish_reason, ended, {}, components, None if versions is None else versions[i]))
    return played


def turn_metrics(played: list[Played], counters: tuple[str, ...]) -> dict[str, float]:
    """Multi-turn episodes: engine turns, tokens the environment inserted (masked from the loss) and each of the
    environment's counts, per episode; the share of episodes by why they ended."""
    n = len(played)
    out = {"turns/engine_turns": sum(p.episode.turns for p in played) / n,
           "turns/inserted_tokens": sum(len(p.episode.tokens) - p.prompt_length - sum(p.episode.sampled)
                                        for p in played) / n}
    out.update({f"turns/{name}": sum(p.counts.get(name, 0) for p in played) / n for name in counters})
    out.update({f"turns/ended_{why}": sum(p.ended == why for p in played) / n for why in ENDINGS})
    return out
