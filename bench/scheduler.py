"""Does ``train.sync_iter=false`` overlap generation with training (issue "Performance", point 6)? Not a test.

On this machine generation and training share two cores, so overlap cannot show in a real run. Here the
engine is a stand-in whose ``generate`` is a fixed wait that uses no CPU (``time.sleep``) and returns fixed
completions; training is the real trainer on the comparison workload (``bench/step_breakdown.py``). The
wait is set to the measured training time of a step, the case where overlap pays most: sync mode takes
wait + train a step, ``sync_iter=false`` and ``grpo-async.py`` max(wait, train), so the ideal ratio is 2x.
``grpo-async.py`` runs as a subprocess; its Ray rollout actor builds the stand-in through a Ray worker setup hook
(:func:`stand_in_hook`, bench only). Prints each run's completions per second and its ratio to sync.

    .venv/bin/python bench/scheduler.py                # 6 steps each mode
"""
import argparse
import csv
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from step_breakdown import GSM8K_DATA, WORKLOAD, workload_config  # noqa: E402

WAIT_ENV = "BENCH_STAND_IN_WAIT_S"


class FixedWaitEngine:
    """An engine that waits ``seconds`` per ``generate`` (no CPU) and answers every prompt with the same
    ``max_tokens`` tokens at log-prob -1; it takes pushes and ignores them."""

    def __init__(self, seconds: float, token_id: int):
        self.seconds, self.token_id = seconds, token_id

    def generate(self, prompt_token_ids, *, n, max_tokens, temperature=1.0, top_p=1.0):
        from torchrl_grpo.engines.base import Completion

        time.sleep(self.seconds)
        return [Completion(i, [self.token_id] * max_tokens, [-1.0] * max_tokens, "length", "42")
                for i in range(len(prompt_token_ids)) for _ in range(n)]

    def push_weights(self, state_dict) -> None:
        pass

    def sampling_state(self):
        return None

    def close(self) -> None:
        pass


def stand_in(tokenizer, seconds: float) -> FixedWaitEngine:
    """The stand-in answering " 42" in ``tokenizer``'s ids after ``seconds``."""
    return FixedWaitEngine(seconds, tokenizer(" 42", add_special_tokens=False)["input_ids"][0])


def stand_in_hook() -> None:
    """Ray worker setup hook: in this worker, engines are the stand-in waiting ``$BENCH_STAND_IN_WAIT_S``."""
    import torchrl_grpo.engines.factory as factory
    from torchrl_grpo.models.loading import load_tokenizer

    def make_engine(backend, model_path, **kwargs):
        return stand_in(load_tokenizer(model_path), float(os.environ[WAIT_ENV]))

    factory.make_engine = make_engine


def async_completions_per_s(data: str, steps: int, wait: float, run_dir: Path) -> float:
    """Completions/s over the steps after the first of ``grpo-async.py`` with one actor on the stand-in."""
    shutil.rmtree(run_dir, ignore_errors=True)
    args = [sys.executable, str(ROOT / "grpo-async.py"), *WORKLOAD, f"env.data_path={data}",
            "train.weight_sync_check=false", f"train.total_dialog_turns={16 * steps}", "ray.init.num_cpus=2",
            "+ray.init.runtime_env.worker_process_setup_hook=scheduler.stand_in_hook",
            f"+ray.init.runtime_env.env_vars.{WAIT_ENV}='{wait}'", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1",  # the actors import this module's hook
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "bench"), os.environ.get("PYTHONPATH")) if p)}
    with open(f"{run_dir}.log", "w") as log:
        done = subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    if done.returncode != 0:
        sys.exit(f"error: grpo-async.py failed (exit {done.returncode}); see {run_dir}.log")
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("step_time")]
    step_times = [float(r["step_time"]) for r in rows]
    return 16 * (len(step_times) - 1) / sum(step_times[1:]), efficiency(rows[1:], wait, overlap=True)


def efficiency(rows: list[dict], wait: float, overlap: bool) -> float:
    """The steps' ideal time over their measured time: each step's own training and the wait, in sequence
    (sync) or overlapped (max of the two). Training time varies by 10-20% from run to run here, which moves
    the completions/s ratios; this says what the scheduler itself loses."""
    train = [float(r["train_time"]) for r in rows]
    ideal = sum(max(t, wait) if overlap else t + wait for t in train)
    return ideal / sum(float(r["step_time"]) for r in rows)


def completions_per_s(cfg, run_dir: Path, wait: float, overlap: bool) -> tuple[float, float, float]:
    """(completions/s over the steps after the first, median train time, :func:`efficiency` over those steps)
    of a sync run on the stand-in."""
    from torchrl_grpo.collect.collector import Collector
    from torchrl_grpo.episodes.trajectories import PromptSampler
    from torchrl_grpo.run.build import build_common, read_inputs
    from torchrl_grpo.run.loop import Run, run_loop
    from torchrl_grpo.run.sources import LocalSource
    from torchrl_grpo.training.weight_sync import EngineSync

    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    c = build_common(read_inputs(cfg, run_dir))
    collector = Collector(c.task, c.tokenizer, stand_in(c.tokenizer, wait), PromptSampler(len(c.task.rows), 0),
                          c.spec.collect, c.turns)
    started = []
    original = collector.collect

    def collect(*args, **kwargs):  # each step's start, to time the steps after the first
        started.append(time.perf_counter())
        return original(*args, **kwargs)

    collector.collect = collect
    source = LocalSource(collector, EngineSync(c.trainer, collector.engine), overlap=overlap)
    run_loop(Run(source, c.trainer, c.state, c.plan.total_steps))
    finished = time.perf_counter()
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train_time")]
    steps = len(started) - 1
    return (c.plan.completions_per_step * steps / (finished - started[1]),
            statistics.median(float(r["train_time"]) for r in rows), efficiency(rows[1:], wait, overlap))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--data", default=GSM8K_DATA, help="env.data_path")
    parser.add_argument("--wait", type=float, default=None,
                        help="seconds a generate takes (default: a step's training)")
    opts = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    def cfg(*extra):
        return workload_config(opts.data, "train.weight_sync_check=false",
                               f"train.total_dialog_turns={16 * opts.steps}", *extra)

    out = ROOT / "outputs" / "bench-scheduler"
    wait = opts.wait
    if wait is None:  # a step's training time, measured with a generation that takes no time
        _, wait, _ = completions_per_s(cfg(), out / "probe", 0.0, overlap=False)
    sync, _, sync_eff = completions_per_s(cfg(), out / "sync", wait, overlap=False)
    overlapped, _, overlap_eff = completions_per_s(cfg("train.sync_iter=false"), out / "overlap", wait, overlap=True)
    in_ray, async_eff = async_completions_per_s(opts.data, opts.steps, wait, out / "async")
    print(f"generation: a fixed wait of {wait:.2f} s" + ("" if opts.wait else " (a step's training time)"))
    print(f"sync: {sync:.2f} completions/s; "
          f"sync_iter=false: {overlapped:.2f} completions/s -> {overlapped / sync:.2f}x; "
          f"grpo-async.py: {in_ray:.2f} completions/s -> {in_ray / sync:.2f}x")
    print(f"scheduler efficiency (ideal / measured step time, from each step's own training time): sync "
          f"{sync_eff:.1%}, sync_iter=false {overlap_eff:.1%}, grpo-async.py {async_eff:.1%}")


if __name__ == "__main__":
    main()
