"""vLLM alone on a GPU, to hold the loop's generation against: a random model of a real shape, then one engine
(``VLLMEngine``, as the loop builds it, in this process) timed on the loop's workload three ways. Not a test.

1. ``llm.generate`` bare: the same prompts and sampling, no seeds (vLLM's own speed);
2. the same with a seed per request, as the loop's engine sends them on a GPU (what seeding costs);
3. ``VLLMEngine.generate``: seeds, the log-prob of every token read out, the text decoded (the loop's generation).
Then the seeding check: the same seeds twice give the same tokens.

    python bench/gpu_vllm_speed.py model DIR --tokenizer ../shared/data/tokenizers/qwen2   # a Qwen3-0.6B shape
    python bench/gpu_vllm_speed.py bare DIR --prompts 64 --n 8 --max-tokens 512 [--enforce-eager] --json out.json
"""
import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def make_model(out: Path, tokenizer: Path, shape: str) -> None:
    """A randomly initialised ``shape`` model in ``out``, with the tokenizer files of ``tokenizer`` beside it."""
    from train_throughput import random_model

    random_model(shape, out)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, out / name)


def prompts_of(model: Path, count: int) -> list[list[int]]:
    """``count`` chat prompts of GSM8K-like length (token ids), the same every time."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    question = ("Natalia sold clips to {k} of her friends in April, and then she sold half as many clips in May. "
                "How many clips did Natalia sell altogether in April and May? Give the answer after ####.")
    return [tok.apply_chat_template([{"role": "user", "content": question.format(k=k)}], add_generation_prompt=True,
                                    tokenize=True, return_dict=False) for k in range(count)]


def timed(fn):
    t0 = time.perf_counter()
    result = fn()  # vLLM's outputs are on the host: the GPU's work is done
    return result, time.perf_counter() - t0


def bare(model: Path, prompts: int, n: int, max_tokens: int, gpu_memory_utilization: float, device: str,
         dtype: str, enforce_eager: bool) -> dict:
    from vllm import SamplingParams

    from torchrl_grpo.engines.vllm import VLLMEngine

    engine = VLLMEngine(str(model), dtype=dtype, device=device, gpu_memory_utilization=gpu_memory_utilization,
                        max_model_len=1024, engine_process="same", seed=0,
                        **({"enforce_eager": True} if enforce_eager else {}))
    ids = prompts_of(model, prompts)
    requests = [{"prompt_token_ids": p} for p in ids]

    def params(seed=None):
        return SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, logprobs=0, detokenize=False, seed=seed)

    def tokens(outputs) -> int:
        return sum(len(c.token_ids) for out in outputs for c in out.outputs)

    engine.llm.generate(requests[:2], params(), use_tqdm=False)  # warm-up
    row = {"enforce_eager": enforce_eager, "engine_start_s": round(engine.start_s, 1), "prompts": prompts, "n": n,
           "max_tokens": max_tokens, "prompt_tokens_mean": round(sum(map(len, ids)) / len(ids), 1)}
    out, seconds = timed(lambda: engine.llm.generate(requests, params(), use_tqdm=False))
    row["bare_tokens_per_s"] = round(tokens(out) / seconds)
    seeds = list(range(1000, 1000 + prompts))
    out, seconds = timed(lambda: engine.llm.generate(requests, [params(s) for s in seeds], use_tqdm=False))
    row["seeded_tokens_per_s"] = round(tokens(out) / seconds)
    first = [list(c.token_ids) for o in out for c in o.outputs]
    again = engine.llm.generate(requests, [params(s) for s in seeds], use_tqdm=False)
    row["same_seeds_same_tokens"] = first == [list(c.token_ids) for o in again for c in o.outputs]
    completions, seconds = timed(lambda: engine.generate(ids, n=n, max_tokens=max_tokens))
    row["engine_generate_tokens_per_s"] = round(sum(len(c.token_ids) for c in completions) / seconds)
    row["completion_tokens_mean"] = round(sum(len(c.token_ids) for c in completions) / len(completions), 1)
    engine.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["model", "bare"])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--tokenizer", type=Path, default=Path("../shared/data/tokenizers/qwen2"))
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM without CUDA graphs or compilation")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.what == "model":
        make_model(args.dir, args.tokenizer, args.shape)
        print(f"random {args.shape} in {args.dir}")
        return
    row = bare(args.dir, args.prompts, args.n, args.max_tokens, args.gpu_memory_utilization, args.device,
               args.dtype, args.enforce_eager)
    print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
