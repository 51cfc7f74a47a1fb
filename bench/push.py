"""Time and memory of a weight push (issue "Performance", point 4). Not a test.

Builds the comparison workload's policy (SmolLM2-135M-Instruct, float32, ``bench/step_breakdown.py``) and its vLLM
engine, in this process (``--engine-process same``, the CPU default) or in its own (``own``, the topology GPUs
use; its pushes by ``--weight-transfer``: vLLM's weight-transfer API over gloo, or the /dev/shm stream), then
pushes the policy's weights ``--pushes`` times and prints the median time of a push, its seconds per GiB sent,
and how far each process's resident set rose above where it was before the push (its peak during the pushes):
this process's and, with ``own``, the engine's worker's.

    .venv/bin/python bench/push.py --engine-process own --weight-transfer collective
    .venv/bin/python bench/push.py --engine-process own --weight-transfer shm
    .venv/bin/python bench/push.py --engine-process same
"""
import argparse
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory import ROOT, GiB, reset_peak, status  # noqa: E402

from step_breakdown import GSM8K_DATA, workload_config  # noqa: E402

from torchrl_grpo.engines.weight_stream import wire_dtype  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-process", choices=("same", "own"), default="own")
    parser.add_argument("--weight-transfer", choices=("collective", "shm"), default="collective")
    parser.add_argument("--pushes", type=int, default=5)
    opts = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import psutil

    from torchrl_grpo.run.build import build_common, build_engine, read_inputs

    cfg = workload_config(GSM8K_DATA, f"inference_model.weight_transfer={opts.weight_transfer}")
    run_dir = ROOT / "outputs" / "bench-push"
    shutil.rmtree(run_dir, ignore_errors=True)
    common = build_common(cfg, read_inputs(cfg, run_dir))
    trainer = common.trainer
    engine = build_engine(cfg, common.spec, common.model_path, trainer.policy, common.tokenizer, seed=0,
                          engine_process=opts.engine_process)
    workers = [p.pid for p in psutil.Process().children(recursive=True) if "Worker" in p.name()]
    watched = {"trainer process": "self", **{f"engine worker {pid}": pid for pid in workers}}
    weights = sum(p.numel() * p.element_size() for p in trainer.policy.parameters()) / GiB
    sent = sum(t.numel() * wire_dtype(t, engine.dtype).itemsize for t in trainer.cpu_weights().values()) / GiB
    try:
        trainer.push_weights(engine)  # the first push makes the push folder or file
        before = {name: status(pid)["VmRSS"] for name, pid in watched.items()}
        for pid in watched.values():
            reset_peak(pid)
        times = []
        for _ in range(opts.pushes):
            started = time.perf_counter()
            trainer.push_weights(engine)
            times.append(time.perf_counter() - started)
        rises = {name: status(pid)["VmHWM"] - before[name] for name, pid in watched.items()}
    finally:
        engine.close()
    transport = engine.weight_transfer if opts.engine_process == "own" else "in place"
    median = statistics.median(times)
    print(f"engine process {opts.engine_process} ({transport}): weights {weights:.2f} GiB, {sent:.2f} GiB sent, "
          f"push median {median:.3f} s, {median / sent:.2f} s/GiB (of {opts.pushes}: {', '.join(f'{t:.3f}' for t in times)})")
    for name, rise in rises.items():
        print(f"  {name}: resident set rose by up to {rise:.2f} GiB during the pushes")


if __name__ == "__main__":
    reset_peak()
    main()
