"""vLLM's sleep mode on a GPU through the project's engine (``inference_model.sleep``): the memory it gives back while
the trainer trains, and that it scores and samples as before once woken. Not a test.

For each ``--case`` (level and ``engine_process``): start ``VLLMEngine`` on a model folder (a random Qwen3-0.6B shape:
``gpu_vllm_speed.py model DIR``), score a fixed sequence and sample greedy completions; sleep; the GPU memory in use
(``mem_get_info``: every process), and a tensor of 90% of what the engine gave back allocated here, as the trainer
would; then what a step does next: push the weights (the model's own, read by transformers on the same GPU; the push
wakes the weights first, the KV cache after); score and sample again: the same log-probs and tokens are expected.

    python bench/gpu_sleep_check.py DIR --case 2:own 1:own 2:same --json out.json
    python bench/gpu_sleep_check.py DIR --case 0:same --device cpu    # the script's own trial on a CPU
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GIB = 2**30


def in_use_gib() -> float:
    if not torch.cuda.is_available():  # the script's own trial on a CPU (level 0)
        return 0.0
    free, total = torch.cuda.mem_get_info(0)
    return (total - free) / GIB


def check(model: Path, level: int, engine_process: str, gpu_memory_utilization: float, device: str) -> dict:
    from transformers import AutoModelForCausalLM

    from gpu_vllm_speed import prompts_of
    from torchrl_grpo.engines.vllm import VLLMEngine

    row = {"level": level, "engine_process": engine_process, "before_engine_gib": round(in_use_gib(), 2)}
    engine = VLLMEngine(str(model), dtype="bfloat16", device=device, gpu_memory_utilization=gpu_memory_utilization,
                        max_model_len=1024, engine_process=engine_process, sleep_level=level, seed=0,
                        weight_transfer="shm" if engine_process == "own" else "auto")
    row["engine_start_s"] = round(engine.start_s, 1)
    prompts = prompts_of(model, 16)
    sequence = prompts[0] + prompts[1]

    def sample():
        return [c.token_ids for c in engine.generate(prompts, n=1, max_tokens=64, temperature=0.0)]

    scores, tokens = engine.score(sequence), sample()
    row["awake_gib"] = round(in_use_gib(), 2)
    t0 = time.perf_counter()
    engine.sleep()
    row["sleep_s"] = round(time.perf_counter() - t0, 2)
    row["asleep_gib"] = round(in_use_gib(), 2)
    given_back = row["awake_gib"] - row["asleep_gib"]
    try:  # the trainer's side takes what the engine gave back
        held = torch.empty(int(0.9 * given_back * GIB), dtype=torch.uint8, device=device)
        row["trainer_took_gib"] = round(held.numel() / GIB, 2)
        del held
    except torch.OutOfMemoryError:
        row["trainer_took_gib"] = 0.0
    torch.cuda.empty_cache()
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to(device)
    row["needs_weights"] = engine.needs_weights
    t0 = time.perf_counter()
    engine.push_weights(policy.state_dict())  # as after every step; level 2 must have it before it samples
    del policy
    torch.cuda.empty_cache()
    row["push_s"] = round(time.perf_counter() - t0, 2)
    row["max_score_gap"] = max(abs(a - b) for a, b in zip(scores, engine.score(sequence)))
    again = sample()
    row["same_greedy_tokens"] = sum(a == b for a, b in zip(tokens, again)) / len(tokens)
    row["woken_gib"] = round(in_use_gib(), 2)
    engine.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--case", nargs="+", default=["2:own", "1:own", "2:same"], help="LEVEL:ENGINE_PROCESS")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for case in args.case:
        level, process = case.split(":")
        try:
            rows.append(check(args.dir, int(level), process, args.gpu_memory_utilization, args.device))
        except Exception as error:  # one case's failure is a result; the next case still runs
            rows.append({"level": int(level), "engine_process": process,
                         "error": f"{type(error).__name__}: {error}"[:300]})
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
