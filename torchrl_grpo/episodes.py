"""Multi-turn episodes, token in and token out (issue 12's brick): the trajectory holds exactly the ids the
engine sampled and the ids the environment inserted, never a conversation rendered to text and tokenized again
(decoding and re-encoding sampled ids does not give them back: BPE merges them differently, and a template
may add an end of turn the model never wrote).

An episode starts from the chat-templated prompt ids. Each engine turn appends its sampled ids with their
sampling log-probs (the stop token included when the engine sampled it). Each environment turn appends the ids
of what it adds after the assistant's text: the template's end of that turn (unless the engine sampled it), the
new messages (feedback, tool results) and the next generation prompt, tokenized on their own
(:func:`inserted_ids`). Only sampled ids are trained on.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from torchrl_grpo.errors import RunError

# stands for the assistant's text when the template renders the conversation: only what follows it is used
_CONTENT = "\u2063assistant turn\u2063"
ENDINGS = ("answer", "max_steps", "length", "context")  # why an episode ended: see Played


@dataclass
class Episode:
    """One episode's ids: ``tokens``, which of them the engine ``sampled`` (the loss mask) and the sampling
    ``log_probs`` (0 where inserted)."""

    tokens: list[int]
    sampled: list[bool] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0  # engine turns so far

    @classmethod
    def start(cls, prompt_ids: list[int]) -> Episode:
        return cls(list(prompt_ids), [False] * len(prompt_ids), [0.0] * len(prompt_ids))

    def add_sampled(self, ids: list[int], log_probs: list[float]) -> None:
        """An engine turn: ``ids`` as sampled, each with its sampling log-prob."""
        if len(ids) != len(log_probs):
            raise ValueError(f"{len(ids)} sampled ids but {len(log_probs)} log-probs")
        self.tokens += ids
        self.sampled += [True] * len(ids)
        self.log_probs += [float(x) for x in log_probs]
        self.turns += 1

    def add_inserted(self, ids: list[int]) -> None:
        """Ids the environment adds (never trained on)."""
        self.tokens += ids
        self.sampled += [False] * len(ids)
        self.log_probs += [0.0] * len(ids)


def inserted_ids(tokenizer, conversation: list[dict], added: list[dict], sampled: list[int]) -> list[int]:
    """The ids the chat template puts after the assistant's last turn of ``conversation`` (whose ids the engine
    ``sampled``) when the messages ``added`` follow and a new assistant turn starts: that turn's end (unless
    the engine sampled it as its last id), ``added`` and the generation prompt, tokenized on their own.

    Tokenized alone they are what the whole rendered conversation tokenizes to at its end when the template's
    end of turn is an added token (ChatML's ``<|im_end|>``: SmolLM2, Qwen): BPE never merges across it. A
    template whose turns end in plain text is a :class:`RunError`."""
    if not conversation or conversation[-1].get("role") != "assistant":
        raise ValueError("the conversation must end with the assistant's turn")
    messages = [*conversation[:-1], {**conversation[-1], "content": _CONTENT}, *added]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    at = text.rfind(_CONTENT)
    if at < 0:
        raise RunError("the chat template drops the assistant's text of the last turn; multi-turn episodes need a "
                       "template that keeps it")
    tail = tokenizer(text[at + len(_CONTENT):], add_special_tokens=False)["input_ids"]
    if not tail or tail[0] not in tokenizer.added_tokens_decoder:  # an added token never merges with its neighbours
        raise RunError("the chat template's end of an assistant turn is not a token of its own (the ids after it "
                       "depend on the text before): multi-turn episodes cannot insert turns token by token")
    return tail[1:] if sampled and sampled[-1] == tail[0] else tail


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

    @property
    def text(self) -> str:
        """The assistant's last turn: what the rewards judge by default."""
        return next(m["content"] for m in reversed(self.conversation) if m["role"] == "assistant")


def play(engine, tokenizer, task, rows: list[dict], *, n: int, max_tokens: int, temperature: float, top_p: float,
         max_model_len: int | None, envs: list | None = None) -> tuple[list[Played], float]:
    """``n`` episodes of each row (prompt-major, as ``Engine.generate``), each in its own TorchRL environment
    (:func:`torchrl_grpo.task_env.make_env`; ``envs``: ones to reuse, at least ``len(rows) * n``), and the seconds
    spent in the engine. The engine's turns go into the environments as sampled ids and text; what the
    environments insert between turns comes back as ids. The first turn of the ``n`` episodes of a row is one
    request (they share the prompt's cache); later turns are one request per episode still going."""
    from tensordict import NonTensorData, TensorDict

    from torchrl_grpo.task_env import make_env, messages_of

    count, envs = len(rows) * n, [] if envs is None else envs
    envs.extend(make_env(task, tokenizer, max_tokens=max_tokens, max_model_len=max_model_len)
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
            completions = engine.generate(prompts, n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p)
        else:
            completions = engine.generate([played[i].episode.tokens for i in going], n=1, max_tokens=max_tokens,
                                          temperature=temperature, top_p=top_p)
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
                env = envs[i].base_env
                p.ended, p.counts = env.ended, dict(env.counts)
                p.components = {k: float(v) for k, v in after["rewards"].items()}
            else:
                states[i] = after
                still.append(i)
        going = still
    return played, generating
