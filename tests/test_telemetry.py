"""What a run leaves besides its checkpoints: samples.jsonl every logging.samples_frequency steps, trimmed on
resume like metrics.csv."""
import json
import math

from helpers import cfg_with
from torchrl_grpo.config.settings import LoggingSettings
from torchrl_grpo.telemetry.recorder import Telemetry


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

    with Telemetry(settings, {}, tmp_path, total_steps=4, start_step=0, resumed=False):  # a fresh run starts a fresh file
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
