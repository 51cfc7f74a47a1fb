"""Where a step's time goes, against two ceilings (issue "Performance", point 5). Not a test.

Runs ``grpo.py`` on the comparison workload of docs/benchmarks.md (GSM8K train questions from
``env.data_path``, 2 prompts x 8 completions x 24 tokens, SmolLM2-135M-Instruct, lr 2e-5, no KL), then reads
its ``metrics.csv`` and prints the completions per second and the median split of a step (steps after the
first) into generate, score, log-probs (``prepare``), forward+backward, optimizer, weight push, weight check and
the rest, and the run's peak resident set (of its largest process). Then, in this process, the
two ceilings on the same model, prompts and sizes:

* rollout efficiency: a bare ``vllm.LLM.generate`` (the very engine, without our wrapper, in the run's
  engine dtype) in tokens/s against the run's ``generation_tokens_per_s`` (target >= 90%);
* trainer overhead: a bare forward + log-softmax + backward + AdamW step on a batch of the run's shape (bf16
  autocast when the run's ``train.mixed_precision`` resolves to it) against the run's ``prepare_time +
  train_time``, and the share of a step spent outside generation and training (target <= 10%).

    .venv/bin/python bench/step_breakdown.py                                 # 10 steps, the defaults
    .venv/bin/python bench/step_breakdown.py train.mixed_precision=false     # extra args: Hydra overrides
"""
import argparse
import csv
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SYSTEM_PROMPT = "Solve the math problem. Reply with only the final answer in the form '#### <number>' and nothing else."
GSM8K_DATA = str(ROOT.parent / "shared" / "data" / "gsm8k")  # the real GSM8K rows beside the repo
WORKLOAD = ["env=gsm8k", f"env.system_prompt={SYSTEM_PROMPT!r}", "env.num_envs=2", "env.repeats=8",
            "inference_model.max_tokens=24", "optimizer.lr=2e-5", "train.kl_to_ref_coeff=0",
            "logging.progress_bar=false", "logging.checkpoint_frequency=0", "logging.samples_frequency=0"]
PARTS = {  # label -> how to read it from a metrics row
    "generate": lambda r: r["generation_time"],
    "score": lambda r: r["score_time"],
    "log-probs (prepare)": lambda r: r["prepare_time"],
    "forward+backward": lambda r: r["train_time"] - r["optimizer_time"],
    "optimizer": lambda r: r["optimizer_time"],
    "weight push": lambda r: r.get("weight_push_time", 0.0),  # none after a step that took no update
    "weight check": lambda r: r.get("weight_check_time", 0.0),
}


def workload_config(data: str, *overrides: str):
    """The comparison workload as Hydra composes it (for the benches that build a run in their process)."""
    from hydra import compose, initialize_config_dir

    from torchrl_grpo.config import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("grpo_gsm8k", [*WORKLOAD, f"env.data_path={data}", *overrides])


def run(overrides: list[str], steps: int, out: Path) -> list[dict]:
    args = [sys.executable, str(ROOT / "grpo.py"), *WORKLOAD, f"train.total_dialog_turns={16 * steps}",
            *overrides, f"hydra.run.dir={out}"]
    with open(f"{out}.log", "w") as log:
        done = subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        sys.exit(f"error: grpo.py failed (exit {done.returncode}); see {out}.log")
    with open(out / "metrics.csv", newline="") as f:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(f)]


def split(rows: list[dict]) -> dict[str, float]:
    med = {name: statistics.median(read(r) for r in rows) for name, read in PARTS.items()}
    step = statistics.median(r["step_time"] for r in rows)
    med["everything else"] = max(0.0, step - sum(med.values()))
    return {"step": step, **med}


def bare_generate_tokens_per_s(engine, prompts: list[list[int]], repeats: int, max_tokens: int) -> float:
    """Tokens/s of the engine's own ``vllm.LLM.generate``: same prompts, n, length and temperature."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(n=8, max_tokens=max_tokens, temperature=1.0, seed=0)
    tokens, seconds = 0, 0.0
    for i in range(repeats):
        chunk = [TokensPrompt(prompt_token_ids=p) for p in prompts[2 * i: 2 * i + 2]]
        started = time.perf_counter()
        outs = engine.llm.generate(chunk, params, use_tqdm=False)
        seconds += time.perf_counter() - started
        tokens += sum(len(c.token_ids) for o in outs for c in o.outputs)
    return tokens / seconds


def bare_train_step_s(model_path: str, prompts: list[list[int]], repeats: int, bf16_autocast: bool,
                      max_tokens: int) -> float:
    """Median seconds of forward (completion logits only) + log-softmax + backward + AdamW step, 16 sequences of
    ``max_tokens`` completion tokens."""
    import torch

    from torchrl_grpo.models.loading import load_policy

    model = load_policy(model_path, dtype=torch.float32, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5, fused=True)
    times = []
    for i in range(repeats + 1):
        pair = prompts[2 * i: 2 * i + 2]
        length = max(len(p) for p in pair) + max_tokens
        ids = torch.tensor([(p + [0] * max_tokens + [0] * length)[:length] for p in pair for _ in range(8)])
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
            logits = model(input_ids=ids, logits_to_keep=max_tokens + 1).logits[:, :-1].float()
        taken = torch.log_softmax(logits, -1).gather(-1, ids[:, -max_tokens:].unsqueeze(-1))
        taken.sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--data", default=GSM8K_DATA, help="env.data_path")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench-step-breakdown")
    parser.add_argument("--run-only", action="store_true", help="the run's split and peak, not the two ceilings")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the run")
    opts = parser.parse_args()
    rows = run([f"env.data_path={opts.data}", *opts.overrides], opts.steps, opts.out)[1:]
    parts = split(rows)
    step = parts.pop("step")
    completions = 16 * len(rows) / sum(r["step_time"] for r in rows)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2 ** 20  # KiB -> GiB: the run's largest process
    print(f"{completions:.2f} completions/s over steps 2-{opts.steps}; peak RSS of the run {peak:.2f} GiB")
    print(f"median step {step:.2f} s over steps 2-{opts.steps}:")
    for name, seconds in parts.items():
        print(f"  {name:<22}{seconds:>8.2f} s {100 * seconds / step:>6.1f}%")
    if opts.run_only:
        return

    from omegaconf import OmegaConf

    from torchrl_grpo.config.spec import resolve_run
    from torchrl_grpo.engines.vllm import VLLMEngine
    from torchrl_grpo.episodes.trajectories import prompt_token_ids
    from torchrl_grpo.models.loading import load_tokenizer
    from torchrl_grpo.models.sources import resolve_model
    from torchrl_grpo.tasks import build_task

    cfg = workload_config(opts.data, *opts.overrides)  # the ceilings take the run's dtypes
    precision, max_tokens = resolve_run(cfg).precision, int(cfg.inference_model.max_tokens)
    engine_dtype = str(precision.engine).removeprefix("torch.")
    model_path = resolve_model("smollm2-135m-instruct")
    task = build_task(OmegaConf.create({"dataset": "gsm8k", "data_path": opts.data, "split": "train",
                                        "system_prompt": SYSTEM_PROMPT}))
    prompts = prompt_token_ids(task, load_tokenizer(model_path), [task.rows[i] for i in range(2 * (opts.steps + 1))])
    engine = VLLMEngine(model_path, dtype=engine_dtype, device="cpu", max_model_len=1024, seed=0)
    try:
        bare_generate_tokens_per_s(engine, prompts, 1, max_tokens)  # warm-up
        bare = bare_generate_tokens_per_s(engine, prompts, opts.steps, max_tokens)
    finally:
        engine.close()
    ours = statistics.median(r["generation_tokens_per_s"] for r in rows)
    print(f"rollout efficiency: {ours:.0f} tokens/s in the run, "
          f"bare vllm generate {bare:.0f} -> {100 * ours / bare:.0f}%")
    bare_step = bare_train_step_s(model_path, prompts, opts.steps - 1, precision.autocast_bf16, max_tokens)
    trained = statistics.median(r["prepare_time"] + r["train_time"] for r in rows)
    outside = step - parts["generate"] - parts["log-probs (prepare)"] - parts["forward+backward"] - parts["optimizer"]
    print(f"trainer: log-probs + train {trained:.2f} s per step, bare forward+backward+step {bare_step:.2f} s "
          f"-> {100 * bare_step / trained:.0f}% efficient")
    print(f"outside generation and training: {outside:.2f} s = {100 * outside / step:.1f}% of a step")


if __name__ == "__main__":
    from torchrl_grpo.core.allocator import apply_memory_settings

    apply_memory_settings()  # the ceilings get the run's malloc and kernel caches
    main()
