"""The memory plan's trainer against the measured peak resident set of a trainer step on the CPU. Not a test.

Each setting runs in a fresh process (with the run's allocator, :func:`apply_memory_settings`):
``bench/train_throughput.py``'s trainer, built as a run builds it over a random model of the shape, trains two steps
of 8 synthetic rows; its peak resident set over them (``VmHWM``, reset after the model is built) is compared
with the plan's process baseline and trainer role (:mod:`torchrl_grpo.config.memory_plan`) for the same config.
Prints a Markdown table (docs/memory-plan.md) and, with ``--json``, the rows.

    python bench/memory_plan.py                       # every setting, about 15 minutes on 2 busy cores
    python bench/memory_plan.py --only tiny           # the settings whose name starts so
    python bench/memory_plan.py --measured rows.json  # predict again, against the peaks measured before
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

ROWS = 8  # rows of a step (train_throughput's GROUP: its smallest step)
STEPS = 1  # after the warm-up: from the second step on, the optimizer's state is there while a backward runs
FP32, AUTOCAST = "train.mixed_precision=false", "train.mixed_precision=true"
NO_CKPT = "train_model.gradient_checkpointing=false"
LORA = "train_model.lora.enabled=true"
# (name, shape, tokens per row, rows per micro-batch, overrides of the grpo_gsm8k recipe)
SETTINGS = [
    ("tiny fp32", "tiny", 128, 8, [FP32]),
    ("smollm2 fp32, ckpt, 4 rows", "smollm2-135m", 128, 4, [FP32]),
    ("smollm2 fp32, no ckpt, 4 rows", "smollm2-135m", 128, 4, [FP32, NO_CKPT]),
    ("smollm2 fp32, no ckpt, 8 rows of 256", "smollm2-135m", 256, 8, [FP32, NO_CKPT]),
    ("smollm2 bf16 autocast, ckpt", "smollm2-135m", 128, 8, [AUTOCAST]),
    ("smollm2 bf16 autocast, no ckpt", "smollm2-135m", 128, 8, [AUTOCAST, NO_CKPT]),
    ("smollm2 bf16 weights, no ckpt", "smollm2-135m", 128, 8, [FP32, NO_CKPT, "train_model.torch_dtype=bfloat16"]),
    ("smollm2 LoRA fp32, no ckpt", "smollm2-135m", 128, 8, [FP32, NO_CKPT, LORA]),
    ("smollm2 LoRA bf16 autocast, ckpt", "smollm2-135m", 128, 8, [AUTOCAST, LORA]),
]
GiB = 2 ** 30


def predicted(shape: str, tokens: int, micro_rows: int, overrides: list[str]) -> dict:
    """The plan's process baseline and trainer role, in GiB, for the setting's config and synthetic rows."""
    from transformers import AutoConfig

    from torchrl_grpo.config.memory_plan import CPU_PROCESS_BASELINE, Batch, ModelShape, trainer_role
    from torchrl_grpo.config.spec import resolve_run
    from train_throughput import PROMPT, SHAPES, bench_config

    model_type, fields = SHAPES[shape]
    model = ModelShape.from_config(AutoConfig.for_model(model_type, **fields).to_dict())
    spec = resolve_run(bench_config(tokens, 0, overrides, ROWS * tokens, micro_rows * tokens))
    completion = tokens - min(PROMPT, tokens // 4)
    role = trainer_role(model, spec, Batch(micro_rows * tokens, micro_rows * completion, ""), None)
    items = [item for item in role.items if item.name != "merged weights for a push"]  # no engine here: no push
    return {"predicted_gib": (CPU_PROCESS_BASELINE + sum(item.bytes for item in items)) / GiB,
            "parts_gib": {item.name: round(item.bytes / GiB, 3) for item in items}}


def one(setting: list) -> None:
    """Measure and predict one setting in this process; print it as a JSON line."""
    from train_throughput import measure

    name, shape, tokens, micro_rows, overrides = setting
    row = {"setting": name, **predicted(shape, tokens, micro_rows, overrides)}
    measured = measure(shape, tokens, STEPS, overrides, ROWS * tokens, micro_rows * tokens)
    row["measured_gib"] = measured["peak_rss_gib"]
    row["error"] = row["predicted_gib"] / row["measured_gib"] - 1
    print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="the settings whose name starts with this")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a setting as JSON: run it in this process
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--measured", type=Path, help="a --json file: its measured peaks, predicted again")
    args = parser.parse_args()
    if args.one:
        one(json.loads(args.one))
        return
    measured = {r["setting"]: r for r in json.loads(args.measured.read_text())} if args.measured else None
    rows = []
    for setting in SETTINGS:
        if args.only and not setting[0].startswith(args.only):
            continue
        if measured is not None:
            if setting[0] in measured and "measured_gib" in measured[setting[0]]:
                row = {"setting": setting[0], **predicted(*setting[1:]),
                       "measured_gib": measured[setting[0]]["measured_gib"]}
                rows.append({**row, "error": row["predicted_gib"] / row["measured_gib"] - 1})
            continue
        out = subprocess.run([sys.executable, __file__, "--one", json.dumps(setting)], capture_output=True,
                             text=True, cwd=ROOT)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{\"setting\"")]
        rows.append(json.loads(lines[-1]) if lines else {"setting": setting[0], "failed": out.stderr[-300:]})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print("| setting | predicted GiB | measured GiB | error |\n|---|---:|---:|---:|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['setting']} | | failed | |")
            continue
        print(f"| {r['setting']} | {r['predicted_gib']:.2f} | {r['measured_gib']:.2f} | {100 * r['error']:+.0f}% |")


if __name__ == "__main__":
    from torchrl_grpo.core.allocator import apply_memory_settings

    apply_memory_settings()  # the run's malloc (tcmalloc) and kernel caches
    main()
