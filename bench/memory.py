"""Where the memory of a run goes (issue "Performance", point 2). Not a test.

Builds the sync run of the comparison workload (``bench/step_breakdown.py``: GSM8K train questions, 2 prompts x 8
completions x 24 tokens, SmolLM2-135M-Instruct) in this process, piece by piece, and reads the resident set
(``VmRSS``) and its peak (``VmHWM``, reset between pieces through ``/proc/self/clear_refs``) after each: imports,
policy, engine (its weights and KV cache), then a few steps (generate, log-probs, forward/backward and optimizer,
weight push). Prints each piece's growth, the tensors' own sizes (weights, gradients, optimizer state, KV cache)
and the peak of the whole process; with the profiler, the tensors live at the peak of the last step's training.

    .venv/bin/python bench/memory.py                                     # the default config, 3 steps
    .venv/bin/python bench/memory.py train.optim_batch_size=4 train.gradient_accumulation_steps=4
    .venv/bin/python bench/memory.py --every-row-trains --live inference_model.max_tokens=128   # the peak's parts
"""
import argparse
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from step_breakdown import GSM8K_DATA, workload_config  # noqa: E402

GiB = 2 ** 30


def status(pid: int | str = "self") -> dict[str, float]:
    """Process ``pid``'s resident set now and its peak since the last :func:`reset_peak`, in GiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024 / GiB
    return out


def reset_peak(pid: int | str = "self") -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


class Ledger:
    """Each piece's growth of the resident set and the peak reached while it ran."""

    def __init__(self):
        reset_peak()
        self.last, self.top, self.rows = status()["VmRSS"], 0.0, []

    def mark(self, piece: str) -> None:
        now = status()
        self.rows.append((piece, now["VmRSS"] - self.last, now["VmHWM"], now["VmRSS"]))
        self.top = max(self.top, now["VmHWM"])
        self.last = now["VmRSS"]
        reset_peak()

    def print(self) -> None:
        print(f"{'piece':<34}{'growth GiB':>11}{'peak GiB':>10}{'after GiB':>10}")
        for piece, growth, peak, after in self.rows:
            print(f"{piece:<34}{growth:>11.2f}{peak:>10.2f}{after:>10.2f}")
        print(f"peak RSS of the process: {self.top:.2f} GiB")


def tensor_bytes(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / GiB


def live_peak(work) -> float:
    """The most tensor memory live at once while ``work()`` runs, in GiB, from the profiler's memory timeline
    (tensors made before it count from when it first touches them)."""
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        work()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    return float(np.array(sizes).sum(1).max()) / GiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--data", default=GSM8K_DATA, help="env.data_path")
    parser.add_argument("--every-row-trains", action="store_true",
                        help="random advantages, so that every row of every step trains (TRL's case)")
    parser.add_argument("--live", action="store_true",
                        help="then train on the last step's batch again under the profiler: the tensors live at "
                             "that training's peak")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides")
    opts = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ledger = Ledger()
    import torch
    import transformers  # noqa: F401
    import vllm  # noqa: F401
    ledger.mark("imports (torch, transformers, vllm)")

    from torchrl_grpo.collect.collector import Collector
    from torchrl_grpo.episodes.trajectories import PromptSampler
    from torchrl_grpo.run.build import build_common, build_engine, build_weight_check, read_inputs

    cfg = workload_config(opts.data, *opts.overrides)
    run_dir = ROOT / "outputs" / "bench-memory"
    shutil.rmtree(run_dir, ignore_errors=True)
    common = build_common(read_inputs(cfg, run_dir))
    trainer = common.trainer
    ledger.mark("policy (and reference)")
    engine = build_engine(common.spec, common.model_path, trainer.policy, common.tokenizer, seed=0)
    ledger.mark("engine (weights, KV cache)")
    check = build_weight_check(common.spec.train, trainer, common.tokenizer, common.spec.precision.engine)
    collector = Collector(common.task, common.tokenizer, engine, PromptSampler(len(common.task.rows), 0),
                          common.spec.collect, common.turns)
    try:
        for step in range(1, opts.steps + 1):
            batch, _, _ = collector.collect(step - 1, None)
            ledger.mark(f"step {step}: generate")
            trainer.prepare(batch)
            ledger.mark(f"step {step}: log-probs, advantages")
            if opts.every_row_trains:  # random advantages: no row is skipped, no step is still
                batch["advantage"] = torch.randn(batch["advantage"].shape,
                                                 generator=torch.Generator().manual_seed(step))
            trainer.optimize(batch)
            ledger.mark(f"step {step}: forward/backward, optimizer")
            trainer.push_weights(engine)
            if check is not None:
                check.after_push(engine)
            ledger.mark(f"step {step}: weight push and check")
        if opts.live:  # the last step's training again, profiled, after the ledger's readings
            live = live_peak(lambda: trainer.optimize(batch))
        kv = (engine.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes or float("nan")) / GiB
    finally:
        engine.close()
    ledger.print()
    params = [p for p in trainer.policy.parameters()]
    state = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    print(f"tensors: policy weights {tensor_bytes(params):.2f} GiB, gradients {tensor_bytes(params):.2f} GiB "
          f"(freed after each step), optimizer state {tensor_bytes(state):.2f} GiB, engine KV cache {kv:.2f} GiB")
    if not opts.live:
        return
    held = 2 * tensor_bytes(params) + tensor_bytes(state)
    print(f"live tensors at the peak of step {opts.steps}'s training (replayed): {live:.2f} GiB, of which "
          f"activations and temporaries {live - held:.2f} GiB (the rest: weights, gradients, optimizer state)")


if __name__ == "__main__":
    from torchrl_grpo.core.allocator import apply_memory_settings

    apply_memory_settings()  # grpo.py's malloc and kernel caches (GRPO_ALLOCATOR=glibc: glibc's)
    main()
