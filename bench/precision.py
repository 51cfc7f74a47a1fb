"""Training-step time of SmolLM2-135M-Instruct in float32, with ``train.mixed_precision`` (bf16 autocast over
float32 master weights) and with pure bf16 weights (``train_model.torch_dtype=bfloat16``), on the shape of
the workloads of docs/benchmarks.md: 16 completions of 24 tokens after a 56-token prompt, one micro-batch, AdamW.
Times the trainer's own ``prepare`` + ``optimize`` (log-probs recomputed, forward, backward, optimizer step); prints the
median over the steps after a warm-up, and each mode's first-step loss and gradient norm against float32.

    .venv/bin/python bench/precision.py              # 6 steps per mode
    .venv/bin/python bench/precision.py --steps 10
"""
import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "training"))
from test_mixed_precision import SETTINGS, make_batch  # noqa: E402  (the test's batch, at the workload's size)
from torchrl_grpo.models.loading import load_policy  # noqa: E402
from torchrl_grpo.models.sources import resolve_model  # noqa: E402
from torchrl_grpo.objective.loss import GRPOLoss  # noqa: E402
from torchrl_grpo.training.trainer import Trainer  # noqa: E402

MODES = {"float32": (torch.float32, False), "mixed_precision": (torch.float32, True),
         "bf16 weights": (torch.bfloat16, False)}


def time_mode(path: str, dtype: torch.dtype, mixed: bool, steps: int) -> tuple[float, dict]:
    policy = load_policy(path, dtype=dtype, device="cpu")
    settings = dataclasses.replace(SETTINGS, group_size=8, micro_batch=16, accumulation=1, mixed_precision=mixed)
    trainer = Trainer(policy, None, GRPOLoss(policy, temperature=1.0), torch.optim.AdamW(policy.parameters(), lr=2e-5),
                      settings, torch.device("cpu"), None)
    times, first = [], None
    for step in range(steps + 1):
        batch = make_batch(policy.config.vocab_size, n=16, length=80, prompt=56)
        started = time.perf_counter()
        metrics = trainer.prepare(batch)
        metrics.update(trainer.optimize(batch))
        times.append(time.perf_counter() - started)
        first = first or metrics
    return statistics.median(times[1:]), first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    path = resolve_model("smollm2-135m-instruct")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    results = {name: time_mode(path, dtype, mixed, args.steps) for name, (dtype, mixed) in MODES.items()}
    base_time, base = results["float32"]
    print(f"{'mode':<18}{'median step':>13}{'speed-up':>10}{'loss':>12}{'grad norm':>12}")
    for name, (seconds, m) in results.items():
        print(f"{name:<18}{seconds:>12.2f}s{base_time / seconds:>9.2f}x{m['loss']:>12.5f}{m['grad_norm']:>12.4f}")


if __name__ == "__main__":
    main()
