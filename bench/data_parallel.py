"""One process vs data-parallel ranks (FSDP2, gloo on the CPU) on one config: runs ``grpo.py`` with
``train_model.num_devices=1`` and ``=2`` (and more with ``--ranks``) and prints, over the steps after the
warm-up, trained completions/s and the median seconds a step spends training (forward, backward, the
gradients' reduce-scatter and the optimizer), in the log-probs before the update, and in the weight push (for
ranks: gathering the weights from the shards, then the push into the engine).

    .venv/bin/python bench/data_parallel.py                              # SmolLM2-135M, gsm_symbolic, 8 steps
    .venv/bin/python bench/data_parallel.py --ranks 1 2 model=tiny       # extra arguments are Hydra overrides
"""
import json
import statistics

from sync_vs_async import options, run_mode, throughput

SPLIT = ("train_time", "prepare_time", "weight_push_time", "step_time")


def main():
    opts = options(__doc__, 8, "bench-data-parallel", lambda parser: parser.add_argument(
        "--ranks", type=int, nargs="+", default=[1, 2], help="train_model.num_devices to compare"))
    figures = {}
    for ranks in opts.ranks:
        name = f"{ranks} rank{'s' if ranks > 1 else ''}"
        result = run_mode(f"ranks{ranks}", "grpo.py", [f"train_model.num_devices={ranks}"], opts.overrides,
                          opts.steps, opts.out)
        rows = [r for r in result["rows"] if int(float(r["step"])) > opts.warmup]
        figures[name] = {**throughput(result, opts.warmup),
                         **{key: round(statistics.median(float(r[key]) for r in rows), 3) for key in SPLIT}}
        print(f"{name:>8}: " + ", ".join(f"{k} {v}" for k, v in figures[name].items()), flush=True)
    print("| trainer | completions/s | train s | log-probs s | push s (gather + push) | step s |\n"
          "|---|---|---|---|---|---|")
    for name, fig in figures.items():
        print(f"| {name} | {fig['completions_per_s']} | {fig['train_time']} | {fig['prepare_time']} | "
              f"{fig['weight_push_time']} | {fig['step_time']} |")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
