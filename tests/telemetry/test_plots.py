"""Figures of a run and of a sweep (torchrl_grpo/telemetry/plots.py, plot.py), from metrics.csv files written by the
real Telemetry class: PNGs that read back, the sweep's ranking, one-line errors."""
import subprocess
import sys

import yaml
from PIL import Image

from helpers import ROOT
from torchrl_grpo.config.settings import LoggingSettings
from torchrl_grpo.telemetry import plots
from torchrl_grpo.telemetry.recorder import Telemetry

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LOGGING = LoggingSettings(log_frequency=100, samples_frequency=0, show_completions=0, progress_bar=False,
                          verbose=False, wandb=False, wandb_mode="auto", wandb_project=None, run_name=None,
                          exp_name="test")


def write_run(run_dir, rewards, eval_accuracy=None, overrides=(), finish=False):
    """A run directory as a run leaves it: metrics.csv through Telemetry (with the evaluation before the first
    step as its own row, as the loops record it); with ``finish`` the end-of-run summary, which writes the
    figures."""
    run_dir.mkdir(parents=True)
    if overrides:
        (run_dir / ".hydra").mkdir()
        (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
    evaluated = eval_accuracy is not None
    with Telemetry(LOGGING, {}, run_dir, len(rewards), 0, resumed=False) as telemetry:
        if evaluated:
            telemetry.record(0, {"eval/accuracy": 0.0, "eval/pass@1": 0.0, "eval/pass@2": 0.0, "eval/reward": 0.0})
        for step, reward in enumerate(rewards, 1):
            metrics = {"reward": reward, "reward/accuracy": reward / 2, "reward/answer_format": 1.0,
                       "completion_length": 10.0 + step, "completion_length_max": 16.0, "kl_to_ref": 0.01 * step,
                       "kl_to_inference": 1e-6, "entropy": 2.0 - 0.05 * step, "clip_fraction": 0.1,
                       "clip_fraction_low": 0.04, "clip_fraction_high": 0.06, "grad_norm": 1.0 / step}
            if evaluated and step == len(rewards):
                metrics.update({"eval/accuracy": eval_accuracy, "eval/pass@1": eval_accuracy,
                                "eval/pass@2": min(1.0, 2 * eval_accuracy), "eval/reward": eval_accuracy})
            telemetry.log(step, metrics, [])
    if finish:
        telemetry.summary(["accuracy", "answer_format"], len(rewards))
    return run_dir


def assert_valid_png(path):
    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    with Image.open(path) as image:
        image.load()
        assert image.width >= 400 and image.height >= 300, (path, image.size)


def test_a_finished_run_writes_its_figures_and_says_where(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", rewards=[0.1 * s for s in range(12)], eval_accuracy=0.5, finish=True)
    out = capsys.readouterr().out
    assert f"plots: {run_dir / 'plots'} (3 figures)" in out
    assert sorted(p.name for p in (run_dir / "plots").iterdir()) == ["eval.png", "policy.png", "reward.png"]
    for png in (run_dir / "plots").iterdir():
        assert_valid_png(png)
    # a run without evaluation has no evaluation figure
    plain = write_run(tmp_path / "plain", rewards=[0.0] * 3, finish=True)
    assert f"plots: {plain / 'plots'} (2 figures)" in capsys.readouterr().out
    assert sorted(p.name for p in (plain / "plots").iterdir()) == ["policy.png", "reward.png"]


def test_a_run_stopped_by_a_fault_still_leaves_its_figures(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    try:
        with Telemetry(LOGGING, {}, run_dir, 10, 0, resumed=False) as telemetry:
            telemetry.log(1, {"reward": 0.5, "grad_norm": 1.0}, [])
            raise RuntimeError("an actor died")
    except RuntimeError:
        pass
    assert f"plots: {run_dir / 'plots'} (2 figures)" in capsys.readouterr().out
    assert_valid_png(run_dir / "plots" / "reward.png")


def test_a_plotting_failure_is_one_warning_not_an_exception(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.csv").write_text("step,reward\n1,0.5\n")
    (run_dir / "plots").write_text("a file where the folder should go")
    plots.write_run_plots(run_dir)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("warning: plots not written: ")
    assert captured.err.count("\n") == 1


def test_an_evaluation_over_several_tasks_gets_its_per_task_accuracy_panel():
    """The columns an evaluation of reasoning-gym's tasks writes (run/evaluation.py: eval/<task>/<component>)."""
    columns = ["step", "reward", "eval/accuracy", "eval/pass@1", "eval/reward", "eval/reward/accuracy",
               "eval/products/accuracy", "eval/products/reward", "eval/chain_sum/accuracy"]
    [per_task] = [p for p in plots.figures(columns)["eval"] if p.title == "evaluation: accuracy per task"]
    assert per_task.columns == ("eval/products/accuracy", "eval/chain_sum/accuracy")


def test_a_multi_turn_run_gets_its_turns_figure_and_eval_tool_calls():
    """The columns multi-turn episodes write (episodes/play.py turn_metrics), in training and in evaluation."""
    columns = ["step", "reward", "turns/engine_turns", "turns/inserted_tokens", "turns/tool_calls",
               "turns/ended_answer", "turns/ended_max_steps", "eval/accuracy", "eval/turns/engine_turns",
               "eval/turns/tool_calls", "eval/turns/ended_answer"]
    figures = plots.figures(columns)
    per_episode, ended, inserted = figures["turns"]
    assert per_episode.columns == ("turns/engine_turns", "turns/tool_calls")
    assert ended.columns == ("turns/ended_answer", "turns/ended_max_steps")
    assert inserted.columns == ("turns/inserted_tokens",)
    [in_eval] = [p for p in figures["eval"] if p.title == "evaluation: per episode"]
    assert in_eval.columns == ("eval/turns/engine_turns", "eval/turns/tool_calls") and not in_eval.per_step
    single = ["step", "reward", "eval/accuracy"]  # a single-turn run: no column of these panels, none drawn
    assert not {c for p in plots.figures(single)["turns"] for c in p.columns} & set(single)


def test_a_throughput_figure_draws_the_speed_and_memory_columns_a_run_logged(tmp_path, monkeypatch):
    """A GPU run's columns give every panel; a CPU run's (no MFU, no GPU memory) the panels it has, with the
    lines it has."""
    drawn, save = {}, plots.save_figure

    def recorded(path, title, panels, *rest):  # each run's throughput panels and the columns drawn on them
        if path.name == "throughput.png":
            drawn[path.parent.parent.name] = [(panel.title, [c for c, _ in lines]) for panel, lines in panels]
        return save(path, title, panels, *rest)

    monkeypatch.setattr(plots, "save_figure", recorded)
    common = {"reward": 0.5, "train_tokens_per_s": 900.0, "generation_tokens_per_s": 300.0, "train_flops_per_s": 2e12,
              "memory/rss_gib": 1.0, "memory/peak_rss_gib": 1.5}
    gpu = {**common, "mfu": 0.25, "memory/train/peak_gib": 3.0, "memory/inference/used_gib": 70.0}
    for name, metrics in (("gpu", gpu), ("cpu", common)):
        (tmp_path / name).mkdir()
        with Telemetry(LOGGING, {}, tmp_path / name, 3, 0, resumed=False) as telemetry:
            for step in (1, 2, 3):
                telemetry.log(step, metrics, [])
        plots.plot_run(tmp_path / name)
        assert_valid_png(tmp_path / name / "plots" / "throughput.png")
    assert drawn["gpu"] == [
        ("tokens per second", ["train_tokens_per_s", "generation_tokens_per_s"]),
        ("training model FLOP/s", ["train_flops_per_s"]),
        ("model FLOPs utilization", ["mfu"]),
        ("GPU memory per role", ["memory/train/peak_gib", "memory/inference/used_gib"]),
        ("trainer process memory", ["memory/rss_gib", "memory/peak_rss_gib"])]
    assert drawn["cpu"] == [
        ("tokens per second", ["train_tokens_per_s", "generation_tokens_per_s"]),
        ("training model FLOP/s", ["train_flops_per_s"]),
        ("trainer process memory", ["memory/rss_gib", "memory/peak_rss_gib"])]


def test_ema_is_an_unbiased_running_mean():
    assert plots.ema([2.0] * 30) == [2.0] * 30  # no pull towards zero at the start
    smoothed = plots.ema([0.0] * 10 + [1.0] * 10)
    assert smoothed[9] == 0.0 and 0.0 < smoothed[10] < smoothed[-1] < 1.0


def sweep_table_rows(sweep_dir):
    lines = (sweep_dir / "sweep.md").read_text().splitlines()
    return lines[0], [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[4:]]


def test_a_sweep_is_overlaid_and_ranked_by_its_last_steps_naming_jobs_by_overrides(tmp_path, capsys):
    sweep = tmp_path / "multirun"
    # job 0 starts better but ends worse: the ranking looks at the last steps
    write_run(sweep / "0", rewards=[1.0] * 5 + [0.2] * 5, overrides=["model=tiny", "optimizer.lr=1e-4"])
    write_run(sweep / "1", rewards=[0.0] * 5 + [0.8] * 5, overrides=["model=tiny", "optimizer.lr=1e-3"])
    plots.main([str(sweep)])
    printed = capsys.readouterr().out
    title, rows = sweep_table_rows(sweep)
    assert "mean reward" in title and printed.startswith(title)
    assert [(row[0], row[1], row[2]) for row in rows] == [("1", "optimizer.lr=1e-3", "0.8"),
                                                         ("2", "optimizer.lr=1e-4", "0.2")]
    assert sorted(p.name for p in (sweep / "plots").iterdir()) == ["sweep_policy.png", "sweep_reward.png"]
    for png in (sweep / "plots").iterdir():
        assert_valid_png(png)


def test_evaluated_runs_are_ranked_by_their_last_evaluation(tmp_path, capsys):
    better_reward = write_run(tmp_path / "a", rewards=[1.0] * 6, eval_accuracy=0.25)
    better_eval = write_run(tmp_path / "b", rewards=[0.0] * 6, eval_accuracy=0.75)
    tied_eval_better_reward = write_run(tmp_path / "c", rewards=[0.5] * 6, eval_accuracy=0.75)
    plots.main([str(better_reward), str(better_eval), str(tied_eval_better_reward)])
    title, rows = sweep_table_rows(tmp_path)
    assert title.startswith("Jobs ranked by last eval/accuracy then by mean reward")
    assert [(row[1], row[2], row[3]) for row in rows] == [("c", "0.75", "0.5"), ("b", "0.75", "0"), ("a", "0.25", "1")]
    assert (tmp_path / "plots" / "sweep_eval.png").is_file()


def test_plot_py_bad_paths_are_one_line_and_exit_code_2(tmp_path):
    (tmp_path / "empty").mkdir()
    for path, named in ((tmp_path / "empty", "metrics.csv"), (tmp_path / "missing", "no such directory")):
        done = subprocess.run([sys.executable, str(ROOT / "plot.py"), str(path)], capture_output=True, text=True,
                              cwd=tmp_path, timeout=60)
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith(f"error: {path}") and named in done.stderr and done.stderr.count("\n") == 1
