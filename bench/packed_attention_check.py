"""Packed rows' attention on a GPU: torch's varlen flash-attention (what packed micro-batches use there in half
precision) against the causal sdpa row by row and the padded computation in float32. Not a test (it needs CUDA).

Prints, for log-probs and their gradients with respect to the weights: each bf16 path's largest gap to the float32
padded computation, and whether the varlen kernel ran.

    python bench/packed_attention_check.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchrl_grpo.models import packed_attention  # noqa: E402
from torchrl_grpo.objective.log_probs import token_log_probs  # noqa: E402


def model(dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=1024,
                                  max_position_embeddings=4096)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to("cuda", dtype)
    packed_attention.attend_by_row(m)
    return m


def scores(m, batch, packed):
    m.zero_grad()
    logp = token_log_probs(m, batch["tokens"], batch["attention"], wanted=batch["completion"], packed=packed)[0]
    logp[batch["completion"]].float().sum().backward()
    grads = torch.cat([p.grad.float().flatten() for p in m.parameters()])
    return logp.float()[batch["completion"]], grads


def main() -> None:
    g = torch.Generator().manual_seed(0)
    lengths = [700, 130, 1500, 64, 900, 333]
    width = max(lengths)
    attention = torch.arange(width) < torch.tensor(lengths).unsqueeze(1)
    completion = attention & (torch.arange(width) >= 32)
    batch = {"tokens": torch.randint(3, 1024, (len(lengths), width), generator=g).cuda(),
             "attention": attention.cuda(), "completion": completion.cuda()}
    reference = scores(model(torch.float32), batch, packed=False)
    bf16 = model(torch.bfloat16)
    calls = []
    varlen = packed_attention.VARLEN

    def counted(*args, **kwargs):
        calls.append(1)
        return varlen(*args, **kwargs)

    packed_attention.VARLEN = counted if varlen is not None else None
    results = {"packed, varlen": scores(bf16, batch, packed=True)}
    ran = len(calls)
    packed_attention.VARLEN = None
    results["packed, sdpa by row"] = scores(bf16, batch, packed=True)
    results["padded"] = scores(bf16, batch, packed=False)
    print(f"varlen_attn calls: {ran} (torch {torch.__version__}, parameters {list(packed_attention.VARLEN_PARAMS)})")
    for name, (logp, grads) in results.items():
        gap = (logp - reference[0]).abs().max().item()
        grad_gap = ((grads - reference[1]).norm() / reference[1].norm()).item()
        print(f"bf16 {name:22s}: log-prob gap {gap:.4f}, gradient relative gap {grad_gap:.4f} (to float32 padded)")


if __name__ == "__main__":
    main()
