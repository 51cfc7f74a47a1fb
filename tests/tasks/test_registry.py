"""Which builder makes the task: the built-in names, the entry points of installed packages (read only when asked
for), and every shipped config's env keys against its task's settings class."""
import dataclasses
import sys

import pytest
from omegaconf import OmegaConf

from helpers import CONFIG_DIR, cfg_with
from torchrl_grpo.config.schema import Env
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.tasks import TASK_BUILDERS, build_task, check_env

SHARED = [field.name for field in dataclasses.fields(Env)]
PLUGIN = '''
import dataclasses

import datasets

from torchrl_grpo.tasks import Task, register_task

@dataclasses.dataclass(frozen=True)
class Settings:
    n: int = 2

@register_task(settings=Settings)
def build(settings):
    rows = datasets.Dataset.from_dict({"question": ["1+1?"] * settings.n, "answer": ["2"] * settings.n})
    return Task("plugged", rows, None).add_reward("exact", lambda completion, row: float(completion == "2"))
'''


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """A package installed as pip would leave it: its module and its dist-info with entry points."""
    (tmp_path / "plugpkg").mkdir()
    (tmp_path / "plugpkg" / "__init__.py").write_text(PLUGIN)
    info = tmp_path / "plugpkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plugpkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[torchrl_grpo.tasks]\nplugged = plugpkg:build\nbroken = plugpkg:nothing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("plugged", "broken"):
        TASK_BUILDERS.pop(name, None)
    sys.modules.pop("plugpkg", None)


def test_an_installed_package_plugs_its_task_in_by_entry_point(installed):
    assert "plugged" not in TASK_BUILDERS  # read only when env.dataset asks for it
    check_env({"dataset": "plugged", "n": 3, "num_envs": 2}, SHARED)
    task = build_task({"dataset": "plugged", "n": 3})
    assert task.name == "plugged" and len(task.rows) == 3 and task.score("2", task.rows[0]) == {"exact": 1.0}
    with pytest.raises(ConfigError, match=r"^env.size: env.dataset=plugged reads no such key; its own: n; drop it"):
        check_env({"dataset": "plugged", "size": 3}, SHARED)
    with pytest.raises(ConfigError, match=r"^env.dataset=broken: loading its entry point plugpkg:nothing raised "
                                          r"AttributeError"):
        build_task({"dataset": "broken"})
    with pytest.raises(ConfigError, match=r"^env.dataset='nope': choose one of .*broken, .*plugged, .*or name your "
                                          r"own builder with env._target_"):
        build_task({"dataset": "nope"})


def test_a_builder_by_import_path(installed):
    task = build_task({"_target_": "plugpkg.build", "n": 1, "rewards": []})
    assert task.name == "plugged" and len(task.rows) == 1
    with pytest.raises(ConfigError, match=r"^env.dataset: env._target_=plugpkg.build reads no such key; its own: n; "
                                          r"drop it \(your own task: start from env=custom\)"):
        check_env({"_target_": "plugpkg.build", "dataset": "openai/gsm8k"}, SHARED)


@pytest.mark.parametrize("name, overrides", [(path.stem, []) for path in sorted(CONFIG_DIR.glob("*.yaml"))]
                         + [("grpo_gsm8k", [f"env={path.stem}"]) for path in sorted((CONFIG_DIR / "env").glob("*.yaml"))
                            if path.stem != "custom"])
def test_every_shipped_config_reads_only_keys_its_task_reads(name, overrides):
    check_env(OmegaConf.to_container(cfg_with(*overrides, name=name).env, resolve=True), SHARED)
