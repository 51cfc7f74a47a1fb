"""Multi-turn episodes, token in and token out: the trajectory holds exactly the ids the
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

from dataclasses import dataclass, field

from torchrl_grpo.core.errors import RunError

# stands for the assistant's text when the template renders the conversation: only what follows it is used
_CONTENT = "\u2063assistant turn\u2063"


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


def inserted_ids(tokenizer, conversation: list[dict], added: list[dict], sampled: list[int],
                 template_kwargs: dict | None = None) -> list[int]:
    """The ids the chat template puts after the assistant's last turn of ``conversation`` (whose ids the engine
    ``sampled``) when the messages ``added`` follow and a new assistant turn starts: that turn's end (unless
    the engine sampled it as its last id), ``added`` and the generation prompt, tokenized on their own
    (``template_kwargs``: the chat template's keyword arguments, as the prompt was rendered with).

    Tokenized alone they are what the whole rendered conversation tokenizes to at its end when the template's
    end of turn is an added token (ChatML's ``<|im_end|>``: SmolLM2, Qwen): BPE never merges across it. A
    template whose turns end in plain text is a :class:`RunError`."""
    if not conversation or conversation[-1].get("role") != "assistant":
        raise ValueError("the conversation must end with the assistant's turn")
    messages = [*conversation[:-1], {**conversation[-1], "content": _CONTENT}, *added]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **(template_kwargs or {}))
    at = text.rfind(_CONTENT)
    if at < 0:
        raise RunError("the chat template drops the assistant's text of the last turn; multi-turn episodes need a "
                       "template that keeps it")
    tail = tokenizer(text[at + len(_CONTENT):], add_special_tokens=False)["input_ids"]
    if not tail or tail[0] not in tokenizer.added_tokens_decoder:  # an added token never merges with its neighbours
        raise RunError("the chat template's end of an assistant turn is not a token of its own (the ids after it "
                       "depend on the text before): multi-turn episodes cannot insert turns token by token")
    return tail[1:] if sampled and sampled[-1] == tail[0] else tail
