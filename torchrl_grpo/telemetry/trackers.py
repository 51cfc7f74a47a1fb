"""Experiment trackers beside metrics.csv: TensorBoard and MLflow, each step's scalar metrics.

MLflow goes through TorchRL's ``MLFlowLogger``, to a SQLite file in the run directory unless
``logging.mlflow.tracking_uri`` names another store (MLflow 3.10+ has no plain-folder store). TensorBoard is
written with torch's ``SummaryWriter`` itself: TorchRL's ``TensorboardLogger`` cannot pass ``purge_step``, so a
resumed run's event files would hold the steps after its checkpoint twice (the killed run's and the resumed
run's); with it TensorBoard drops the first ones, as metrics.csv does.
"""
from __future__ import annotations

import math
from pathlib import Path

from torchrl_grpo.config.settings import LoggingSettings


class TensorBoard:
    """Scalars in ``<run dir>/tensorboard``; ``resume_step``: the checkpoint's step, whose later events go."""

    def __init__(self, run_dir: Path, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"),
                                    purge_step=None if resume_step is None else resume_step + 1)

    def log(self, step: int, row: dict) -> None:
        for key, value in row.items():
            if key != "step" and _scalar(value):
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MLflow:
    """Scalars in an MLflow run of experiment ``logging.mlflow.experiment`` (each start or resume a run)."""

    def __init__(self, settings: LoggingSettings, run_dir: Path, config: dict):
        import mlflow
        from torchrl.record.loggers import MLFlowLogger

        uri = settings.mlflow_tracking_uri or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        self.logger = MLFlowLogger(settings.mlflow_experiment or settings.exp_name, tracking_uri=uri)
        self.logger.experiment  # noqa: B018 (starts the run)
        mlflow.set_tag("run_dir", str(run_dir))
        self.mlflow = mlflow
        if config:
            self.logger.log_hparams(_flat(config))

    def log(self, step: int, row: dict) -> None:
        self.logger.log_metrics({_mlflow_name(k): float(v) for k, v in row.items() if k != "step" and _scalar(v)},
                                step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def start_trackers(settings: LoggingSettings, config: dict, run_dir: Path, resume_step: int | None) -> list:
    """The trackers ``logging.*`` asks for (each ``log(step, row)`` and ``close()``)."""
    trackers = []
    if settings.tensorboard:
        trackers.append(TensorBoard(run_dir, resume_step))
    if settings.mlflow:
        trackers.append(MLflow(settings, run_dir, config))
    return trackers


def _scalar(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _mlflow_name(key: str) -> str:
    """MLflow's metric names allow letters, digits and ``_ - . space : /``: anything else becomes ``_``."""
    return "".join(c if c.isalnum() or c in "_-. :/" else "_" for c in key)


def _flat(config: dict, prefix: str = "") -> dict:
    """The resolved config as MLflow parameters: ``optimizer.lr`` -> value (values as text, cut at MLflow's 6000
    characters)."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "."))
        else:
            out[name] = str(value)[:6000]
    return out
