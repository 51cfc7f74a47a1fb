"""Time and memory of a weight push (issue "Performance", point 4). Not a test.

Builds the comparison workload's policy (SmolLM2-135M-Instruct, float32, ``bench/step_breakdown.py``) and its vLLM
engine, in this process (``--engine-process same``, the CPU default) or in its own (``own``, the topology GPUs
use; its pushes by ``--weight-transfer``: vLLM's weight-transfer API over gloo, or the /dev/shm stream), then
pushes the policy's weights ``--pushes`` times and prints the median time of a push, its seconds per GiB sent,
and how far each process's resident set rose above where it was before the push (its peak during the pushes):
this process's and, with ``own``, the engine's worker's. ``--engine-process actor``: the engine of one Ray
rollout actor (``grpo-async.py``'s), pushed to over the gloo collective or (``shm``) through Ray's object store,
timed from the push until the actor has loaded and checked it (the trainer's snapshot of the weights included).
``--lora-sync adapter|merged``: the policy with LoRA (r 16, alpha 32, every linear layer), pushing its adapter only
or every weight with the adapter merged in (``train_model.lora.sync``). ``--shape``: a randomly initialised model of
one of ``bench/train_throughput.py``'s shapes (with the tiny model's tokenizer) instead of SmolLM2.

    .venv/bin/python bench/push.py --engine-process own --weight-transfer collective
    .venv/bin/python bench/push.py --engine-process own --weight-transfer shm
    .venv/bin/python bench/push.py --engine-process same
    .venv/bin/python bench/push.py --engine-process actor --weight-transfer collective|shm
    .venv/bin/python bench/push.py --engine-process same|own --lora-sync adapter|merged [--shape qwen2.5-1.5b]
"""
import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory import ROOT, GiB, reset_peak, status  # noqa: E402
from step_breakdown import GSM8K_DATA, workload_config  # noqa: E402
from torchrl_grpo.engines.weight_stream import wire_dtype  # noqa: E402
from torchrl_grpo.training.weight_sync import PolicyWeights, snapshot  # noqa: E402
from train_throughput import SHAPES, random_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-process", choices=("same", "own", "actor"), default="own")
    parser.add_argument("--weight-transfer", choices=("collective", "shm"), default="collective")
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--lora-sync", choices=("adapter", "merged"), help="LoRA r 16, pushing this (default: no LoRA)")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a random model of this shape instead of SmolLM2")
    opts = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import psutil

    from torchrl_grpo.run.build import build_common, build_engine, read_inputs

    actor = ["mode=async"] if opts.engine_process == "actor" else []
    lora = [] if opts.lora_sync is None else ["train_model.lora.enabled=true", "train_model.lora.r=16",
                                              "train_model.lora.alpha=32", f"train_model.lora.sync={opts.lora_sync}"]
    model = [] if opts.shape is None else [f"model.name={shaped_model(opts.shape)}"]
    cfg = workload_config(GSM8K_DATA, f"inference_model.weight_transfer={opts.weight_transfer}", *actor, *lora, *model)
    run_dir = ROOT / "outputs" / "bench-push"
    shutil.rmtree(run_dir, ignore_errors=True)
    common = build_common(read_inputs(cfg, run_dir))
    trainer = common.trainer
    if actor:
        return actor_pushes(common, opts.pushes)
    engine = build_engine(common.spec, common.model_path, trainer.policy, common.tokenizer, seed=0,
                          engine_process=opts.engine_process)
    workers = [p.pid for p in psutil.Process().children(recursive=True) if "Worker" in p.name()]
    watched = {"trainer process": "self", **{f"engine worker {pid}": pid for pid in workers}}
    weights = sum(p.numel() * p.element_size() for p in trainer.policy.parameters()) / GiB
    export = PolicyWeights(trainer.policy)
    if opts.lora_sync == "adapter":
        sent = export.adapter().nbytes / GiB

        def push():
            engine.push_adapter(export.adapter())
    else:
        sent = sum(t.numel() * wire_dtype(t, engine.dtype).itemsize for t in snapshot(export).values()) / GiB

        def push():
            engine.push_weights(export.weights())
    try:
        push()  # the first push makes the push folder or file
        before = {name: status(pid)["VmRSS"] for name, pid in watched.items()}
        for pid in watched.values():
            reset_peak(pid)
        times = []
        for _ in range(opts.pushes):
            started = time.perf_counter()
            push()
            times.append(time.perf_counter() - started)
        rises = {name: status(pid)["VmHWM"] - before[name] for name, pid in watched.items()}
    finally:
        engine.close()
    transport = "the LoRA adapter" if opts.lora_sync == "adapter" else engine.transport.name
    median = statistics.median(times)
    print(f"engine process {opts.engine_process} ({transport}): weights {weights:.2f} GiB, {sent:.4f} GiB sent, "
          f"push median {median:.3f} s, {median / sent:.2f} s/GiB "
          f"(of {opts.pushes}: {', '.join(f'{t:.3f}' for t in times)})")
    for name, rise in rises.items():
        print(f"  {name}: resident set rose by up to {rise:.2f} GiB during the pushes")


def shaped_model(shape: str) -> Path:
    """A random model of ``shape`` with the tiny model's tokenizer, made once under outputs/."""
    from torchrl_grpo.models.sources import resolve_model

    folder = ROOT / "outputs" / "bench-push-models" / shape
    if not (folder / "config.json").is_file():
        random_model(shape, folder)
        tiny = Path(resolve_model("tiny"))
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tiny / name).is_file():
                shutil.copy(tiny / name, folder / name)
    return folder


def actor_pushes(common, pushes: int) -> None:
    """``pushes`` pushes to one rollout actor, each waited for until it has landed (one more first, not counted:
    it finds the group formed, yet runs slower); the actor's first collect is done before (it would delay it)."""
    from torchrl_grpo.collect.rollout_actors import ActorPool

    dtype = common.spec.precision.engine
    with ActorPool(common.spec, [None], 0, 0) as pool:
        pool.start_collecting()
        pool.ray.wait(list(pool.pending), timeout=600)
        times, sent = [], None
        for version in range(1, pushes + 2):
            started = time.perf_counter()
            weights = snapshot(PolicyWeights(common.trainer.policy), dtype)
            pool.push(weights, version)
            for landed in list(pool.pushes):  # a link's future, or the object store push's Ray reference
                landed.result() if hasattr(landed, "result") else pool.ray.get(landed)
            times.append(time.perf_counter() - started)
            sent = sum(t.numel() * t.element_size() for t in weights.values()) / GiB
        transport = pool.transport.name
    median = statistics.median(times[1:])
    print(f"rollout actor ({transport}): {sent:.2f} GiB sent, push median {median:.3f} s, {median / sent:.2f} s/GiB "
          f"(of {pushes}: {', '.join(f'{t:.3f}' for t in times[1:])}; the first, not counted: {times[0]:.3f} s)")


if __name__ == "__main__":
    reset_peak()
    main()
