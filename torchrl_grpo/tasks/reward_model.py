"""A reward model as a reward (``env.reward_model``): a Hugging Face sequence-classification model scoring each
(prompt, completion) pair, a batch at a time, in TRL's reward signature.

The pair is rendered with the reward model's own chat template when it has one (the prompt's messages, then
the completion as the assistant's turn), else as the prompt text followed by the completion. The score is the
logit of ``label`` (0: the single output of a reward model). The model runs on ``device`` (``auto``: the first
GPU where there is one, else the CPU): a GPU of its own, or one it shares with another model.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchrl_grpo.core.errors import ConfigError, one_line


class RewardModel:
    def __init__(self, path: str, device: str = "auto", batch_size: int = 16, max_length: int = 1024,
                 torch_dtype: str = "auto", label: int = 0, trust_remote_code: bool = False):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = (torch.bfloat16 if device.startswith("cuda") else torch.float32) if torch_dtype == "auto" else \
            getattr(torch, str(torch_dtype))
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                path, dtype=dtype, trust_remote_code=trust_remote_code).to(device).eval()
        except Exception as err:
            raise ConfigError(f"env.reward_model.path={path}: cannot load a sequence-classification model from it "
                              f"({one_line(err)})") from None
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        if self.model.config.pad_token_id is None:  # the model finds each row's last token by the pad id
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        if not 0 <= label < self.model.config.num_labels:
            raise ConfigError(f"env.reward_model.label={label}: the model has {self.model.config.num_labels} "
                              "output(s)")
        self.device, self.batch_size, self.max_length, self.label = device, batch_size, max_length, label

    def __call__(self, prompts: list, completions: list, completion_ids=None, **columns) -> list[float]:
        import torch

        texts = [self.render(p, c) for p, c in zip(prompts, completions)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[start:start + self.batch_size], padding=True, truncation=True,
                                   max_length=self.max_length, add_special_tokens=False, return_tensors="pt")
            with torch.no_grad():
                logits = self.model(**batch.to(self.device)).logits
            scores += logits[:, self.label].float().tolist()
        return scores

    def render(self, prompt: Any, completion: Any) -> str:
        """The text the model scores for one pair (prompt and completion as text or chat messages)."""
        answer = completion if isinstance(completion, str) else completion[-1]["content"]
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": answer}],
                                                      tokenize=False)
        text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in messages)
        return text + answer


def reward_model_entry(spec: Mapping[str, Any]) -> dict:
    """``env.reward_model`` as an ``env.rewards``-style entry: the scorer, its name and weight."""
    if not isinstance(spec, Mapping) or not spec.get("path"):
        raise ConfigError("env.reward_model: give at least its path, e.g. {path: my-org/my-reward-model}")
    known = {"path", "device", "batch_size", "max_length", "torch_dtype", "label", "trust_remote_code", "name",
             "weight"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ConfigError(f"env.reward_model.{unknown[0]}: unknown key; the keys are {', '.join(sorted(known))}")
    kwargs = {k: v for k, v in spec.items() if k not in ("name", "weight")}
    return {"fn": RewardModel(**kwargs), "name": spec.get("name") or "reward_model",
            "weight": float(spec.get("weight", 1.0))}
