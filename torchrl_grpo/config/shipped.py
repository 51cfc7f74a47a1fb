"""The config tree the package ships (``CONFIG_DIR``): the names of its top-level configs, and a copy of the
tree for a user to edit and run with ``--config-path`` (whole, because a config composes others: grpo_arithmetic
is grpo_gsm8k with a few values changed, and each takes options from the env, model, loss and mode groups)."""
from __future__ import annotations

import shutil
from pathlib import Path

from torchrl_grpo.config import CONFIG_DIR
from torchrl_grpo.core.errors import ConfigError


def shipped_recipes() -> list[str]:
    """The top-level configs, as ``--config-name`` takes them."""
    return sorted(path.stem for path in CONFIG_DIR.glob("*.yaml"))


def copy_recipe(name: str, dest: str) -> str:
    """Copy the tree into the new folder ``dest``, after checking ``name`` is one of its configs."""
    if name not in shipped_recipes():
        raise ConfigError(f"config {name!r} is not shipped: use one of {', '.join(shipped_recipes())}")
    target = Path(dest)
    if target.exists() and any(target.iterdir()):
        raise ConfigError(f"{dest} exists and is not empty: give a new folder as DEST")
    shutil.copytree(CONFIG_DIR, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    return str(target)
