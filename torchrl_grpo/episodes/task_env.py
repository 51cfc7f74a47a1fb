"""A task as a TorchRL environment: one episode of a :class:`~torchrl_grpo.tasks.Task`, token in and token out.

``make_env`` builds ``TransformedEnv(TaskEnv, Compose(*env.transforms, InsertedTokens, EpisodeReward))``:

- :class:`TaskEnv` (an ``EnvBase``, batch ``(1,)`` like TorchRL's ``ChatEnv``): ``reset`` takes the dataset
  ``row`` and gives the conversation (``("history", "prompt")``, a ``ChatHistory`` as TorchRL's history-mode
  transforms read it) and its chat-templated ids (``("tokens", "prompt")``); ``step`` takes the engine's turn
  (``("tokens", "response")``, ``("text", "response")``, ``finish_reason``), appends it, lets the task's
  :class:`~torchrl_grpo.episodes.turn_envs.TurnEnv` answer (tool output, feedback) and is done after ``max_turns``
  turns.
- the user's TorchRL transforms (``env.transforms``), e.g. torchrl's history-mode tool transforms: they append
  messages to the history.
- :class:`InsertedTokens` (ours): the messages added after the engine's turn enter the ids token by token
  (:func:`~torchrl_grpo.episodes.episode.inserted_ids`); none added ends the episode (nothing answered: the turn was the
  final answer), and so does a next turn that would not fit ``max_model_len``.
- :class:`EpisodeReward` (ours): at the end, the reward components (``TurnEnv.score``, else the task's rewards
  of the last turn) under ``("rewards", name)`` and their weighted total as ``reward``.

Why not ``torchrl.envs.llm.ChatEnv``: in tokens mode its step inserts nothing between turns (the next prompt is
the sampled ids, without the tool message or the generation prompt), and in history mode the ids are the
conversation rendered to text and tokenized again, which is not what the engine sampled
(``tests/episodes/test_task_env.py`` pins both).
"""
from __future__ import annotations

import torch
from tensordict import NonTensorData, TensorDict, TensorDictBase, lazy_stack
from torchrl.data import Composite, NonTensor, Unbounded
from torchrl.data.llm import History
from torchrl.envs import Compose, EnvBase, Transform, TransformedEnv

from torchrl_grpo.core.errors import ConfigError, import_target, one_line
from torchrl_grpo.core.secrets import masker
from torchrl_grpo.episodes.episode import inserted_ids
from torchrl_grpo.episodes.trajectories import prompt_token_ids
from torchrl_grpo.episodes.turn_envs import TurnEnv, Turns


def _chat_history(messages: list[dict]):
    from torchrl.modules.llm.policies import ChatHistory  # torchrl.modules.llm imports in seconds: only when used

    history = lazy_stack([History(role=m["role"], content=m["content"]) for m in messages]).unsqueeze(0)
    return ChatHistory(prompt=history, batch_size=(1,))


def messages_of(td: TensorDictBase) -> list[dict]:
    """The conversation of ``("history", "prompt")`` as message dicts (TorchRL's "<none>" padding dropped)."""
    history = td["history"].prompt[0]
    return [{"role": r, "content": c} for r, c in zip(history.role, history.content) if r != "<none>"]


def _last_turn(conversation: list[dict]) -> int:
    """The index of the engine's last turn: messages after it are what the environment added."""
    return max(i for i, m in enumerate(conversation) if m["role"] == "assistant")


def _single(value):
    """A batch-(1,) non-tensor entry's value (a list of one where TensorDict stacked it)."""
    return value[0] if isinstance(value, list) else value


def _flags(done: bool) -> dict:
    return {"done": torch.tensor([[done]]), "terminated": torch.tensor([[done]])}


class TaskEnv(EnvBase):
    """One episode of ``task`` (see the module's docstring). Its state travels in the TensorDict, as TorchRL's
    state entries: the dataset ``row``, the engine ``turns`` so far, the environment's ``counts`` (e.g. tool calls)
    and, once done, why the episode ``ended`` (``episodes.play.ENDINGS``; :func:`episode_state` reads the last
    two)."""

    input_mode = "history"  # TorchRL's tool transforms check it: they read and extend ("history", "prompt")

    def __init__(self, task, turns: Turns, tokenizer):
        super().__init__(batch_size=(1,))
        self.task, self.turns, self.tokenizer = task, turns, tokenizer
        ids = Unbounded(shape=(1, -1), dtype=torch.long)
        self.full_observation_spec = Composite(
            history=NonTensor(example_data=None, shape=(1,)), tokens=Composite(prompt=ids, shape=(1,)), shape=(1,))
        self.full_action_spec = Composite(
            tokens=Composite(response=ids.clone(), shape=(1,)),
            text=Composite(response=NonTensor(example_data="", shape=(1,)), shape=(1,)),
            finish_reason=NonTensor(example_data="stop", shape=(1,)), shape=(1,))
        self.full_state_spec = Composite(
            row=NonTensor(example_data={}, shape=(1,)), turns=NonTensor(example_data=0, shape=(1,)),
            counts=NonTensor(example_data={}, shape=(1,)), ended=NonTensor(example_data="", shape=(1,)), shape=(1,))
        self.full_reward_spec = Composite(reward=Unbounded(shape=(1, 1)), shape=(1,))

    def _reset(self, td: TensorDictBase | None) -> TensorDictBase:
        row = _single(td["row"])
        out = TensorDict({"history": _chat_history(self.task.messages(row)), **_flags(False)}, batch_size=(1,))
        out["tokens", "prompt"] = torch.tensor([prompt_token_ids(self.task, self.tokenizer, [row])[0]])
        _set_state(out, row, turns=0, counts={}, ended="")
        return out

    def _step(self, td: TensorDictBase) -> TensorDictBase:
        row, text, finish_reason = _single(td["row"]), _single(td["text", "response"]), _single(td["finish_reason"])
        turns, counts, ended = _single(td["turns"]) + 1, dict(_single(td["counts"])), ""
        conversation = [*messages_of(td), {"role": "assistant", "content": text}]
        done = turns >= self.turns.max_turns
        if done:
            ended = "max_steps" if finish_reason == "stop" else "length"
        elif self.turns.env is not None:
            reply = self.turns.env.step(self.task, row, conversation)
            for name, count in reply.counts.items():
                counts[name] = counts.get(name, 0) + int(count)
            if not reply.done:
                conversation += masker().tree(reply.messages)  # a tool that read a secret tells it no one
        out = TensorDict({"history": _chat_history(conversation), **_flags(done), "reward": torch.zeros(1, 1)},
                         batch_size=(1,))
        out["tokens", "prompt"] = torch.cat([td["tokens", "prompt"], td["tokens", "response"]], -1)
        _set_state(out, row, turns=turns, counts=counts, ended=ended)
        return out

    def _set_seed(self, seed: int | None) -> None:  # deterministic: nothing to seed
        pass


def _set_state(td: TensorDictBase, row: dict, *, turns: int, counts: dict, ended: str) -> None:
    for key, value in (("row", row), ("turns", turns), ("counts", counts), ("ended", ended)):
        td[key] = NonTensorData(value, batch_size=(1,))


def episode_state(td: TensorDictBase) -> tuple[str, dict[str, int]]:
    """A finished episode's last TensorDict -> (why it ended, the environment's counts)."""
    return _single(td["ended"]), dict(_single(td["counts"]))


class InsertedTokens(Transform):
    """Appends to ``("tokens", "prompt")`` the ids of the messages that follow the engine's last turn (the template's
    end of that turn unless sampled, the messages, the generation prompt), tokenized on their own; ends the
    episode when there are none or when the next turn (``max_tokens`` more) would not fit ``max_model_len``."""

    def __init__(self, tokenizer, max_tokens: int, max_model_len: int | None, template_kwargs: dict | None = None):
        super().__init__()
        self.tokenizer, self.max_tokens, self.max_model_len = tokenizer, max_tokens, max_model_len
        self.template_kwargs = template_kwargs or {}  # the task's chat_template_kwargs, as its prompts had them

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        if bool(next_tensordict["done"].any()):
            return next_tensordict
        conversation = messages_of(next_tensordict)
        last = _last_turn(conversation)
        added = conversation[last + 1:]
        if not added:
            cut = _single(tensordict["finish_reason"]) == "length"
            return _end(next_tensordict, "length" if cut else "answer")
        tokens = next_tensordict["tokens", "prompt"]
        ids = inserted_ids(self.tokenizer, conversation[: last + 1], added, tokens[0, -1:].tolist(),
                           self.template_kwargs)
        if self.max_model_len is not None and tokens.shape[-1] + len(ids) + self.max_tokens > self.max_model_len:
            return _end(next_tensordict, "context")
        next_tensordict["tokens", "prompt"] = torch.cat([tokens, torch.tensor([ids], dtype=tokens.dtype)], -1)
        return next_tensordict

    def _reset(self, tensordict, tensordict_reset):
        return tensordict_reset


def _end(td: TensorDictBase, why: str) -> TensorDictBase:
    td["ended"] = NonTensorData(why, batch_size=(1,))
    td.update(_flags(True))
    return td


class EpisodeReward(Transform):
    """At the end of an episode: its reward components under ``("rewards", name)`` (unweighted) and ``reward``,
    their weighted total (the task's weights)."""

    def __init__(self, task, turn_env: TurnEnv | None = None):
        super().__init__()
        self.task, self.turn_env = task, turn_env

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        if not bool(next_tensordict["done"].any()):
            return next_tensordict
        task, row, conversation = self.task, _single(next_tensordict["row"]), messages_of(next_tensordict)
        conversation = conversation[: _last_turn(conversation) + 1]
        if self.turn_env is None:
            components = task.score(conversation[-1]["content"], row)
        else:
            components = self.turn_env.score(task, row, conversation, _single(next_tensordict["turns"]))
        next_tensordict["reward"] = torch.tensor([[task.total(components)]])
        next_tensordict["rewards"] = TensorDict({k: torch.tensor([[float(v)]], dtype=torch.float64)  # exact
                                                 for k, v in components.items()},
                                                batch_size=(1,))
        return next_tensordict

    def _reset(self, tensordict, tensordict_reset):
        return tensordict_reset


def build_transforms(specs) -> list:
    """``env.transforms``: TorchRL transforms, each ``{_target_: a Transform class or a function returning one,
    **kwargs}``, built anew for each episode's environment (a transform belongs to one environment)."""
    built = []
    for i, spec in enumerate(specs):
        key = f"env.transforms[{i}]"
        make = import_target(spec, key, "transform's class or factory", "mypkg.envs.calculator")
        kwargs = {k: v for k, v in spec.items() if k != "_target_"}
        try:
            transform = make(**kwargs)
        except Exception as err:
            raise ConfigError(f"{key}: {spec['_target_']}({', '.join(kwargs)}) raised {one_line(err)}") from None
        if not isinstance(transform, Transform):
            raise ConfigError(f"{key}._target_={spec['_target_']}: gave a {type(transform).__name__}, not a torchrl "
                              "Transform")
        built.append(transform)
    return built


def make_env(task, turns: Turns, tokenizer, *, max_tokens: int, max_model_len: int | None) -> TransformedEnv:
    """One episode's environment: :class:`TaskEnv` with the user's transforms (``env.transforms``), then ours."""
    return TransformedEnv(TaskEnv(task, turns, tokenizer), Compose(
        *build_transforms(turns.transforms),
        InsertedTokens(tokenizer, max_tokens, max_model_len, task.chat_template_kwargs),
        EpisodeReward(task, turns.env)))
