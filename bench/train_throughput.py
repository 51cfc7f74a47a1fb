"""The trainer's tokens/s, model FLOP/s and MFU on a random model of a real model's shape. Not a test.

Builds the trainer as a run does (``build_trainer`` over the ``grpo_gsm8k`` recipe: its loss, AdamW, bf16 weights
on a GPU, gradient checkpointing, SDPA), from a randomly initialised model of the shape named, and trains it on
synthetic batches of rows of ``--tokens`` tokens each (a 256-token prompt, the rest completion, random rewards:
every row moves the weights). A step is 128k tokens: micro-batches of 16k tokens (16k-token rows one at a time),
8 of them accumulated into one optimizer step. No engine: generation at these lengths is not what is timed.
Prints the median over the steps after the first of the trainer's own ``train_tokens_per_s``,
``train_flops_per_s`` and ``mfu`` (:mod:`torchrl_grpo.models.flops`), the peak device memory and the peak resident
set of the process over those steps (what a CPU run holds), and what ``torchrl-grpo plan`` predicts the trainer
holds at this micro-batch (:func:`planned_gib`).

    python bench/train_throughput.py --shape qwen3-0.6b --tokens 2048 16384     # on a GPU
    python bench/train_throughput.py --shape tiny --tokens 64 --step-tokens 1024 --micro-tokens 256  # a CPU
    python bench/train_throughput.py --shape tiny-151k --tokens 2048 --step-tokens 16384 --micro-tokens 4096 --steps 2
    python bench/train_throughput.py --shape smollm2-135m --tokens 256 --step-tokens 4096 --micro-tokens 1024 \
        --ragged [train.micro_batch_tokens=1024]                                # padded against packed, a CPU
    python bench/train_throughput.py --chunk-mib 1048576 ...   # whole logits at once, as before chunked log-probs
    python bench/train_throughput.py --json results.json ...                    # also write the rows
"""
import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchrl_grpo.config.memory_plan import Batch, GiB, ModelShape, trainer_role  # noqa: E402
from torchrl_grpo.config.spec import resolve_run  # noqa: E402
from torchrl_grpo.models import packed_attention  # noqa: E402
from torchrl_grpo.objective import log_probs  # noqa: E402
from torchrl_grpo.run.build import build_trainer, seed_everything  # noqa: E402
from torchrl_grpo.run.memory import device_memory  # noqa: E402

# transformers configs of the models' published shapes (their config.json), so that nothing is downloaded
SHAPES = {
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                                 max_position_embeddings=40960, rope_theta=1e6)),
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                   tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1e6)),
    "smollm2-135m": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                   num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                                   max_position_embeddings=8192, rope_theta=100000.0)),
    # the tiny model's layers with Qwen's vocabulary: the memory of the head and the log-softmax dominates
    "tiny-151k": ("qwen3", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, vocab_size=151936, tie_word_embeddings=True,
                                max_position_embeddings=4096)),
    "tiny": ("qwen3", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True,
                           max_position_embeddings=4096)),
}
STEP_TOKENS, MICRO_TOKENS, GROUP, PROMPT = 131072, 16384, 8, 256


def random_model(shape: str, out: Path) -> None:
    """A randomly initialised model of ``shape``, saved where ``build_trainer`` loads it from."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = SHAPES[shape]
    config = AutoConfig.for_model(model_type, **fields)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)


def plan(tokens: int, step_tokens: int, micro_tokens: int) -> tuple[int, int, int]:
    """(rows per step, rows per micro-batch, micro-batches per optimizer step) for rows of ``tokens`` tokens."""
    micro = max(1, micro_tokens // tokens)
    rows = max(GROUP, step_tokens // tokens // GROUP * GROUP)
    return rows, micro, -(-rows // micro)


def synthetic_batch(rows: int, tokens: int, vocab: int, seed: int, ragged: bool = False):
    """Rows of ``tokens`` tokens; ``ragged``: each row's completion stops at a length drawn uniformly between an
    eighth of its budget and all of it, right-padded (completions that end early, as sampled ones do)."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    prompt = min(PROMPT, tokens // 4)
    budget = tokens - prompt
    ends = prompt + (torch.randint(max(1, budget // 8), budget + 1, (rows,), generator=g) if ragged
                     else torch.full((rows,), budget))
    attention = torch.arange(tokens) < ends.unsqueeze(1)
    completion = attention.clone()
    completion[:, :prompt] = False
    return TensorDict({"tokens": torch.randint(3, vocab, (rows, tokens), generator=g),
                       "attention_mask": attention, "completion_mask": completion,
                       "sample_log_probs": torch.where(completion, -2.0, 0.0),
                       "reward": torch.rand(rows, generator=g)}, batch_size=[rows])


def bench_config(tokens: int, steps: int, overrides: list[str], step_tokens: int = STEP_TOKENS,
                 micro_tokens: int = MICRO_TOKENS):
    """The ``grpo_gsm8k`` recipe composed for rows of ``tokens`` tokens cut as :func:`plan` cuts them."""
    from hydra import compose, initialize_config_dir

    from torchrl_grpo.config import CONFIG_DIR

    rows, micro, accumulation = plan(tokens, step_tokens, micro_tokens)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("grpo_gsm8k", [f"env.repeats={GROUP}", f"env.num_envs={rows // GROUP}",
                                      f"train.optim_batch_size={micro}",
                                      f"train.gradient_accumulation_steps={accumulation}",
                                      f"inference_model.max_tokens={tokens}", "train.kl_to_ref_coeff=0",
                                      f"train.total_dialog_turns={rows * (steps + 1)}", *overrides])


def measure(shape: str, tokens: int, steps: int, overrides: list[str],
            step_tokens: int = STEP_TOKENS, micro_tokens: int = MICRO_TOKENS, ragged: bool = False) -> dict:
    """One shape at one row length: the medians of the trainer's metrics over ``steps`` steps after a warm-up."""
    rows, micro, _ = plan(tokens, step_tokens, micro_tokens)
    cfg = bench_config(tokens, steps, overrides, step_tokens, micro_tokens)
    seed_everything(0)
    spec = resolve_run(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        random_model(shape, Path(tmp))
        trainer = build_trainer(spec, tmp)
    vocab = trainer.policy.config.vocab_size
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(trainer.device)
    reset_peak_rss()
    per_step = []
    for step in range(steps + 1):
        batch = synthetic_batch(rows, tokens, vocab, seed=step, ragged=ragged)
        trainer.prepare(batch)
        per_step.append(trainer.optimize(batch))
    timed = per_step[1:] or per_step

    def median(key):
        values = [m[key] for m in timed if key in m]
        return statistics.median(values) if values else None

    peak = torch.cuda.max_memory_allocated(trainer.device) / 2**30 if trainer.device.type == "cuda" else None
    reserved = torch.cuda.max_memory_reserved(trainer.device) / 2**30 if trainer.device.type == "cuda" else None
    return {"shape": shape, "tokens_per_row": tokens, "rows_per_step": rows, "micro_batch_rows": micro,
            "device": torch.cuda.get_device_name(trainer.device) if trainer.device.type == "cuda" else "cpu",
            "weights": str(next(trainer.policy.parameters()).dtype).removeprefix("torch."),
            "steps_timed": len(timed), "train_tokens_per_s": median("train_tokens_per_s"),
            "train_flops_per_s": median("train_flops_per_s"), "mfu": median("mfu"), "peak_memory_gib": peak,
            "peak_reserved_gib": reserved, "peak_rss_gib": peak_rss_gib(),
            "planned_gib": planned_gib(trainer, spec, micro * tokens, micro * (tokens - min(PROMPT, tokens // 4))),
            "chunk_mib": log_probs.chunk_bytes(trainer.device) >> 20, "ragged": ragged, "overrides": overrides,
            "varlen": packed_attention.VARLEN is not None, "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled(),
            "loss_finite": all(m["loss"] == m["loss"] for m in per_step)}


def planned_gib(trainer, spec, tokens: int, completion: int) -> float:
    """What the memory plan (``torchrl-grpo plan``) gives the trainer for micro-batches of ``tokens`` tokens
    (``train.micro_batch_tokens`` where set), ``completion`` of them scored, on the trainer's device; a CPU's plan
    leaves the process's baseline out, as :func:`reset_peak_rss` does."""
    budget = spec.plan.micro_batch_tokens
    if budget is not None:
        tokens, completion = budget, budget * completion // tokens
    shape = ModelShape.from_config(trainer.policy.config.to_dict())
    device = str(trainer.device)
    batch = Batch(tokens, completion, f"{tokens} tokens")
    return trainer_role(shape, spec, batch, device_memory(device), device).bytes / GiB


def reset_peak_rss() -> None:
    """Start the process's peak resident set (VmHWM) again from its current size (Linux), so that each shape's
    steps are measured apart from the model building and from the shapes before."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_gib() -> float:
    """The process's peak resident set since :func:`reset_peak_rss`: the CPU's memory in use, in GiB."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", default=["qwen3-0.6b"], choices=sorted(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[2048, 16384], help="tokens per row")
    parser.add_argument("--steps", type=int, default=3, help="timed steps, after one warm-up step")
    parser.add_argument("--step-tokens", type=int, default=STEP_TOKENS, help="tokens per optimizer step")
    parser.add_argument("--micro-tokens", type=int, default=MICRO_TOKENS, help="tokens per micro-batch")
    parser.add_argument("--ragged", action="store_true", help="completions of random lengths, right-padded")
    parser.add_argument("--chunk-mib", type=int,
                        help="float32 logits per log-prob chunk, at least (default: the package's "
                        "chunk_bytes); 1048576: the whole micro-batch's logits at once")
    parser.add_argument("--packed-attention", choices=["auto", "sdpa"], default="auto",
                        help="packed rows' attention: auto (varlen flash-attention on a GPU in half precision), "
                        "or sdpa row by row")
    parser.add_argument("--no-cudnn-sdp", action="store_true", help="keep sdpa off its cuDNN kernels")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("overrides", nargs="*",
                        help="Hydra overrides of the recipe, e.g. train_model.gradient_checkpointing=false")
    args = parser.parse_args()
    if args.chunk_mib:
        log_probs.CHUNK_BYTES = args.chunk_mib << 20
    if args.packed_attention == "sdpa":
        packed_attention.VARLEN = None
    if args.no_cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)
    rows = []
    for shape in args.shape:
        for tokens in args.tokens:
            try:
                rows.append(measure(shape, tokens, args.steps, args.overrides, args.step_tokens, args.micro_tokens,
                                    args.ragged))
            except torch.OutOfMemoryError as error:
                rows.append({"shape": shape, "tokens_per_row": tokens, "error": f"out of memory: {error}"[:200]})
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"\n{'shape':14s} {'tokens/row':>10s} {'tokens/s':>10s} {'TFLOP/s':>8s} {'MFU':>6s} {'peak GiB':>8s} "
          f"{'peak RSS GiB':>12s} {'planned GiB':>11s}")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:14s} {r['tokens_per_row']:10d} {r['error'][:60]}")
            continue
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        peak = "-" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.1f}"
        print(f"{r['shape']:14s} {r['tokens_per_row']:10d} {r['train_tokens_per_s']:10.0f} "
              f"{r['train_flops_per_s'] / 1e12:8.2f} {mfu:>6s} {peak:>8s} {r['peak_rss_gib']:12.2f} "
              f"{r['planned_gib']:11.2f}")


if __name__ == "__main__":
    main()
