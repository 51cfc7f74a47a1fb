"""What a run leaves besides its checkpoints: samples.jsonl every logging.samples_frequency steps, trimmed on
resume like metrics.csv; the memory figures of each step (telemetry/hardware.py: the CUDA calls stood in for), and
the console's and the summary's speed and memory."""
import json
import math
from types import SimpleNamespace

import pytest
import torch

from helpers import cfg_with
from torchrl_grpo.config.settings import LoggingSettings
from torchrl_grpo.telemetry import hardware
from torchrl_grpo.telemetry.recorder import Telemetry

GIB = 2**30


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def sample(text, reward, prompt="Q"):
    return {"prompt": prompt, "completion": text, "reward": reward, "advantage": reward - 0.5,
            "reward/accuracy": reward, "reward/judge": math.nan}


def test_samples_are_written_every_n_steps_and_trimmed_on_resume(tmp_path):
    settings = LoggingSettings.from_config(cfg_with("logging.samples_frequency=2", "logging.progress_bar=false"))
    with Telemetry(settings, {}, tmp_path, total_steps=4, start_step=0, resumed=False) as telemetry:
        for step in range(1, 5):
            telemetry.log(step, {"reward": 0.5}, [sample(f"answer {step}a ✓", 1.0), sample(f"answer {step}b", 0.0)])
    written = _lines(tmp_path / "samples.jsonl")
    assert [(r["step"], r["completion"], r["reward"]) for r in written] == [
        (2, "answer 2a ✓", 1.0), (2, "answer 2b", 0.0), (4, "answer 4a ✓", 1.0), (4, "answer 4b", 0.0)]
    assert written[0] == {"step": 2, "prompt": "Q", "completion": "answer 2a ✓", "reward": 1.0, "advantage": 0.5,
                          "reward/accuracy": 1.0, "reward/judge": None}  # a reward that did not apply: null

    with Telemetry(settings, {}, tmp_path, total_steps=4, start_step=3, resumed=True) as telemetry:  # resumed at step 3
        telemetry.log(4, {"reward": 0.25}, [sample("again", 0.5)])
    assert [(r["step"], r["completion"]) for r in _lines(tmp_path / "samples.jsonl")] == [
        (2, "answer 2a ✓"), (2, "answer 2b"), (4, "again")]

    # a fresh run starts a fresh file
    with Telemetry(settings, {}, tmp_path, total_steps=4, start_step=0, resumed=False):
        pass
    assert not (tmp_path / "samples.jsonl").exists()


def test_metrics_rows_live_in_the_file_not_in_memory(tmp_path):
    """A long run's memory must not grow with its steps (bench/soak.py found metrics.csv's rows held in
    memory). 400 rows of 60 metrics: the writer holds next to nothing more after them; the file and the end-of-run
    summary read them back exactly."""
    import tracemalloc

    from torchrl_grpo.telemetry.recorder import MetricsCSV, summarize

    metrics = MetricsCSV(tmp_path / "metrics.csv")
    row = {f"metric_{i}": i / 7 for i in range(60)}
    metrics.write({"step": 0, **row})
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for step in range(1, 401):
        metrics.write({"step": step, **row, "reward": step / 3})
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 100_000, grown  # held in memory, the 400 rows took about 650 KB
    rows = metrics.rows()
    assert [int(r["step"]) for r in rows] == list(range(401)) and float(rows[400]["reward"]) == 400 / 3
    assert summarize(rows, ["reward"], 2)["reward"].last_mean == (399 / 3 + 400 / 3) / 2


@pytest.mark.needs("mlflow", "tensorboard")  # the trackers extra
def test_tensorboard_and_mlflow_get_each_step_once_across_a_resume(tmp_path):
    """Both trackers on, as a run writes them: steps 1-4, then a run resumed from the checkpoint of step 2 writes
    steps 3-4 again. TensorBoard keeps the resumed values only (purge_step); MLflow (a SQLite store in the run
    directory, read back with its own client) has the first run's four steps and the resumed run's two."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    settings = LoggingSettings.from_config(cfg_with("logging.tensorboard=true", "logging.mlflow.enabled=true",
                                                    "logging.progress_bar=false", "train.exp_name=tracked"))
    config = {"optimizer": {"lr": 1e-5}, "env": {"dataset": "gsm_symbolic"}}
    with Telemetry(settings, config, tmp_path, total_steps=4, start_step=0, resumed=False) as telemetry:
        for step in range(1, 5):
            telemetry.log(step, {"reward": step / 10, "eval/pass@1": 0.5, "loss_objective": math.nan}, [])
    with Telemetry(settings, config, tmp_path, total_steps=4, start_step=2, resumed=True) as telemetry:
        for step in (3, 4):
            telemetry.log(step, {"reward": step, "eval/pass@1": 0.5, "loss_objective": math.nan}, [])

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("reward")] == [(1, 0.1), (2, 0.2), (3, 3.0), (4, 4.0)]
    assert "loss_objective" not in events.Tags()["scalars"]  # a NaN is not a point

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tracked")
    first, resumed = sorted(client.search_runs([experiment.experiment_id]), key=lambda r: r.info.start_time)
    history = {run: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward")]
               for run in (first, resumed)}
    assert sorted(history[first]) == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
    assert sorted(history[resumed]) == [(3, 3.0), (4, 4.0)]
    assert first.data.params["optimizer.lr"] == "1e-05" and first.data.tags["run_dir"] == str(tmp_path)
    assert "eval/pass_1" in first.data.metrics  # '@' is not allowed in MLflow's names


def test_a_tracker_without_its_package_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    import pytest

    from torchrl_grpo.config.validate import validate
    from torchrl_grpo.core.errors import ConfigError

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else find_spec(name, *a))
    validate(cfg_with("logging.tensorboard=true"))  # installed here
    with pytest.raises(ConfigError, match=r'^logging.mlflow.enabled=true: the mlflow package is not installed; pip '
                                          r'install -e "\.\[trackers\]" \(or set logging.mlflow.enabled=false\)$'):
        validate(cfg_with("logging.mlflow.enabled=true"))


class FakeGPUs:
    """torch.cuda's allocator counters and mem_get_info, per device index, as the CUDA allocator keeps them."""

    def __init__(self, allocated: dict[int, int], reserved: dict[int, int], free_total: dict[int, tuple[int, int]]):
        self.allocated, self.reserved, self.free_total = allocated, reserved, free_total
        self.peak = dict(allocated)
        self.resets: list[int] = []

    def use(self, monkeypatch):
        for name, function in (("memory_allocated", lambda d: self.allocated[d.index]),
                               ("memory_reserved", lambda d: self.reserved[d.index]),
                               ("max_memory_allocated", lambda d: self.peak[d.index]),
                               ("reset_peak_memory_stats", self.reset_peak),
                               ("mem_get_info", lambda d: self.free_total[d.index])):
            monkeypatch.setattr(torch.cuda, name, function)

    def reset_peak(self, device):
        self.resets.append(device.index)
        self.peak[device.index] = self.allocated[device.index]

    def hold(self, index: int, nbytes: int) -> None:
        """Tensors of ``nbytes`` (negative: freed) on GPU ``index``."""
        self.allocated[index] += nbytes
        self.peak[index] = max(self.peak[index], self.allocated[index])


def test_each_roles_gpus_report_their_memory_in_gib_and_the_peak_starts_again_each_step(monkeypatch):
    """Train on GPUs 0 and 1 (a layer split), the reference on 1 and 2 (GPU 1 is counted with train), the engine on
    GPU 3 (and a CPU device, which has no GPU figure)."""
    gpus = FakeGPUs(allocated={0: 1 * GIB, 1: 2 * GIB, 2: GIB // 2}, reserved={0: 4 * GIB, 1: 4 * GIB, 2: GIB},
                    free_total={3: (30 * GIB, 80 * GIB)})
    gpus.use(monkeypatch)
    cuda = [torch.device(f"cuda:{i}") for i in range(3)]
    gpus.hold(0, 5 * GIB)  # before the probe: model loading, not a step's peak
    gpus.hold(0, -5 * GIB)
    probe = hardware.MemoryProbe(train=cuda[:2], ref=cuda[1:], inference=["cuda:3", "cpu"])
    assert sorted(gpus.resets) == [0, 1, 2]
    gpus.hold(0, 3 * GIB)  # step 1: activations on GPU 0, 2 GiB of them kept (optimizer state)
    gpus.hold(0, -GIB)
    gpus.hold(2, GIB // 4)
    gpus.hold(2, -GIB // 4)
    first = probe.read()
    assert set(first) == {"memory/rss_gib", "memory/peak_rss_gib", "memory/inference/used_gib",
                          *(f"memory/{role}/{kind}_gib" for role in ("train", "ref")
                            for kind in ("allocated", "reserved", "peak"))}
    assert {k: v for k, v in first.items() if "rss" not in k} == {
        "memory/train/allocated_gib": 3 + 2, "memory/train/reserved_gib": 8, "memory/train/peak_gib": 4 + 2,
        "memory/ref/allocated_gib": 0.5, "memory/ref/reserved_gib": 1, "memory/ref/peak_gib": 0.75,
        "memory/inference/used_gib": 50}
    second = probe.read()  # step 2 allocated nothing more: its peak is what is held
    assert second["memory/train/peak_gib"] == 5 and second["memory/ref/peak_gib"] == 0.5


def test_a_reference_on_the_train_gpus_and_an_engine_on_the_cpu_have_no_figures_of_their_own(monkeypatch):
    gpus = FakeGPUs(allocated={0: GIB}, reserved={0: 2 * GIB}, free_total={})
    gpus.use(monkeypatch)
    metrics = hardware.MemoryProbe([torch.device("cuda:0")], [torch.device("cuda:0")], ["cpu"]).read()
    assert sorted(k for k in metrics if "rss" not in k) == [
        "memory/train/allocated_gib", "memory/train/peak_gib", "memory/train/reserved_gib"]


def test_an_engine_in_this_process_on_the_train_gpu_is_not_counted_as_the_trainers(monkeypatch):
    """vLLM in this process allocates its weights and KV cache through torch's allocator: measured on an H100, a tiny
    trainer's peak read 39.5 GiB, nearly all the engine's. What the engine held once started is taken off."""
    gpus = FakeGPUs(allocated={0: GIB}, reserved={0: 2 * GIB}, free_total={0: (10 * GIB, 80 * GIB)})
    gpus.use(monkeypatch)
    gpus.hold(0, 40 * GIB)  # the engine starts: 40 GiB held from then on
    gpus.reserved[0] += 40 * GIB
    cuda0 = torch.device("cuda:0")
    probe = hardware.MemoryProbe([cuda0], [], ["cuda:0"], engine_held={"cuda:0": 40 * GIB})
    gpus.hold(0, 3 * GIB)  # the step: generation and training activations, then freed
    gpus.hold(0, -3 * GIB)
    metrics = probe.read()
    assert metrics["memory/train/allocated_gib"] == 1 and metrics["memory/train/reserved_gib"] == 2
    assert metrics["memory/train/peak_gib"] == 4
    assert metrics["memory/inference/used_gib"] == 70  # the device's, all processes and roles together


def test_on_the_cpu_the_process_resident_set_is_reported_current_and_peak():
    probe = hardware.MemoryProbe([], [], ["cpu"])
    before = probe.read()
    assert set(before) == {"memory/rss_gib", "memory/peak_rss_gib"}
    assert 0 < before["memory/rss_gib"] <= before["memory/peak_rss_gib"]
    held = b"x" * (256 * 2**20)  # 256 MiB written: resident
    after = probe.read()
    assert after["memory/rss_gib"] - before["memory/rss_gib"] > 0.2
    assert after["memory/peak_rss_gib"] >= after["memory/rss_gib"] and len(held) == 256 * 2**20


def test_process_memory_reads_proc_status_in_gib_and_falls_back_to_getrusage(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t 3145728 kB\nVmRSS:\t  1048576 kB\nThreads:\t4\n")
    assert hardware.process_memory(status) == {"memory/rss_gib": 1.0, "memory/peak_rss_gib": 3.0}
    fallback = hardware.process_memory(tmp_path / "no_proc")  # macOS: the peak alone
    assert list(fallback) == ["memory/peak_rss_gib"]
    assert fallback["memory/peak_rss_gib"] == pytest.approx(hardware.process_memory()["memory/peak_rss_gib"], rel=0.05)


def test_the_gpus_of_a_model_are_those_its_parameters_are_on():
    def model(*devices):
        return SimpleNamespace(parameters=lambda: [SimpleNamespace(device=torch.device(d)) for d in devices])

    assert hardware.cuda_devices(model("cuda:1", "cuda:1", "cuda:0"), None, model("cpu", "cuda:2")) == [
        torch.device("cuda:1"), torch.device("cuda:0"), torch.device("cuda:2")]
    assert hardware.cuda_devices(model("cpu"), None) == []


def test_the_step_line_shows_tokens_per_second_and_peak_memory_and_the_summary_their_run_figures(tmp_path, capsys):
    settings = LoggingSettings.from_config(cfg_with("logging.progress_bar=false", "logging.log_frequency=1",
                                                    "logging.samples_frequency=0"))
    steps = [  # a GPU run's steps, then a step as on the CPU (no GPU figures), then one without either
        {"reward": 0.5, "train_tokens_per_s": 1000.0, "train_flops_per_s": 1e12, "mfu": 0.2,
         "generation_tokens_per_s": 300.0, "memory/train/peak_gib": 2.5, "memory/inference/used_gib": 70.0,
         "memory/peak_rss_gib": 1.25},
        {"reward": 0.5, "train_tokens_per_s": 2000.0, "train_flops_per_s": 3e12, "mfu": 0.3,
         "generation_tokens_per_s": 500.0, "memory/train/peak_gib": 3.0, "memory/inference/used_gib": 69.0,
         "memory/peak_rss_gib": 1.5},
        {"reward": 0.5, "train_tokens_per_s": 3000.0, "memory/peak_rss_gib": 0.75},
        {"reward": 0.5},
    ]
    with Telemetry(settings, {}, tmp_path, total_steps=4, start_step=0, resumed=False) as telemetry:
        for step, metrics in enumerate(steps, 1):
            telemetry.log(step, metrics, [])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "step 1 | reward 0.5 | tok/s 1000 | mem 2.5"  # the train GPUs' peak over the process's
    assert lines[2] == "step 3 | reward 0.5 | tok/s 3000 | mem 0.75"  # the CPU: the process's peak
    assert lines[3] == "step 4 | reward 0.5"
    telemetry.summary([], total_steps=4)
    assert ("  hardware: train 2000 tokens/s, 2 TFLOP/s, MFU 25.0%, generation 400 tokens/s | peak memory GiB: "
            "train 3.00, inference 70.00, process RSS 1.50") in capsys.readouterr().out.splitlines()
