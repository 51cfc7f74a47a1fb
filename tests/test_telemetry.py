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
