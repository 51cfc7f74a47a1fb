"""The policy's LoRA adapter as an engine loads it: PEFT's saved format (``adapter_config.json`` and
``adapter_model.safetensors``), with no base weight in it. A push of the adapter moves its few MB where a merged push
moves every weight of the model, and computes no merge (``train_model.lora.sync``).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from torchrl_grpo.models.loading import unwrap
from torchrl_grpo.parallel.ranks import full_tensor

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


@dataclass
class Adapter:
    """One version of the adapter: its PEFT config (JSON-ready) and its tensors under PEFT's saved names."""

    config: dict
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def save(self, folder: str) -> None:
        """Write it as PEFT's ``save_pretrained`` does, into ``folder`` (made; the caller gives a new one)."""
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        save_file({name: t.contiguous() for name, t in self.tensors.items()}, os.path.join(folder, WEIGHTS_FILE))
        with open(os.path.join(folder, CONFIG_FILE), "w") as f:
            json.dump(self.config, f)


def adapter_config(model) -> dict:
    """The active adapter's PEFT config as ``adapter_config.json`` holds it."""
    model = unwrap(model)
    config = model.peft_config[model.active_adapter].to_dict()
    return json.loads(json.dumps({k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}))


def adapter_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """``(PEFT saved name, tensor)`` of the active adapter, one at a time, detached. A model sharded with FSDP2 gives
    each gathered whole when it is reached (every rank must iterate in step)."""
    from peft import get_peft_model_state_dict

    model = unwrap(model)
    for name, t in get_peft_model_state_dict(model, adapter_name=model.active_adapter).items():
        yield name, full_tensor(t.detach())


def is_lora(model) -> bool:
    """Whether ``model`` is a PEFT model (with an adapter to push, or to switch off for the reference)."""
    model = unwrap(model)
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


class AdapterOff(torch.nn.Module):
    """The policy with its LoRA adapter switched off: the model it started from, which is the reference a LoRA run's
    KL term needs, with no second copy of the base weights (TRL computes its reference log-probs so too)."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, *args, **kwargs):
        with unwrap(self.policy).disable_adapter():
            return self.policy(*args, **kwargs)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.policy.get_input_embeddings()

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.policy.get_output_embeddings()
