"""The package as users install and call it: the wheel pip builds (its configs, license, command), and the
``torchrl-grpo`` command run as a user runs it, from a folder of their own."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import ROOT, SCRIPT_ENV, metric_rows, needs_vllm
from torchrl_grpo.config.shipped import shipped_recipes

COMMAND = Path(sys.executable).parent / "torchrl-grpo"  # the console script `pip install -e .` put in the venv


def cli(*args, cwd, timeout=120):
    return subprocess.run([str(COMMAND), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **SCRIPT_ENV})


def test_the_wheel_carries_the_configs_the_license_and_the_command(tmp_path):
    """A non-editable install has only what the wheel holds: every shipped YAML must be in it."""
    src = tmp_path / "src"  # a copy: building leaves build/ and *.egg-info beside the sources
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "torchrl_grpo", src / "torchrl_grpo", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=120)
    (wheel,) = (tmp_path / "dist").glob("torchrl_grpo-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {str(p.relative_to(ROOT)) for p in (ROOT / "torchrl_grpo").rglob("*.yaml")}
    assert shipped and shipped <= set(names), sorted(shipped - set(names))
    assert not [n for n in names if n.startswith(("tests/", "bench/", "docs/"))]
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("dist-info/METADATA"))).decode()
    assert "License-Expression: MIT" in meta and "Name: torchrl-grpo" in meta
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "torchrl-grpo = torchrl_grpo.run.cli:main" in entry_points


def test_env_reports_versions_and_devices(tmp_path):
    out = cli("env", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    import torch

    lines = dict(line.split(None, 1) for line in out.stdout.splitlines())
    assert lines["torch"] == torch.__version__
    assert lines["torchrl-grpo"] == "0.1.0"
    assert (lines["cuda"] == "not available") == (not torch.cuda.is_available())
    assert lines["cpu"].startswith(f"{os.cpu_count()} cores, bf16 ")


@pytest.mark.parametrize("args, says", [(["trian"], "unknown command 'trian'"),
                                        (["config", "grpo_nope"], "config 'grpo_nope' is not shipped"),
                                        (["train", "model=tinyy"], "Could not find 'model/tinyy'")])
def test_bad_commands_are_one_line_and_exit_2(tmp_path, args, says):
    out = cli(*args, cwd=tmp_path)
    assert out.returncode == 2 and says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


@needs_vllm
def test_a_copied_config_edited_and_run_from_the_users_folder(tmp_path):
    """``config NAME DEST`` then ``train --config-path DEST`` (relative to the user's folder, as they type it):
    the edits are what runs, the job is named as grpo.py's (grpo.log), and the same command as a script agrees."""
    out = cli("config", "grpo_arithmetic", "mine", cwd=tmp_path)
    assert out.returncode == 0 and "--config-path mine --config-name grpo_arithmetic" in out.stdout, out.stderr
    assert sorted(p.stem for p in (tmp_path / "mine").glob("*.yaml")) == shipped_recipes()
    mine = tmp_path / "mine" / "grpo_arithmetic.yaml"
    text = mine.read_text().replace("  - override env: arithmetic",
                                    "  - override env: arithmetic\n  - override model: tiny")
    mine.write_text(text.replace("total_dialog_turns: 1600 ", "total_dialog_turns: 32 "))
    out = cli("train", "--config-path", "mine", "--config-name", "grpo_arithmetic", "logging.eval_frequency=0",
              "logging.progress_bar=false", "inference_model.max_tokens=4", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    assert (run_dir / "grpo.log").exists()
    rows = metric_rows(run_dir)
    assert len(rows) == 2  # 32 turns of the edited file, 16 completions a step
    assert "model/tiny" not in (run_dir / ".hydra" / "overrides.yaml").read_text()  # the file did it, not an override
    assert "  name: tiny\n" in (run_dir / ".hydra" / "config.yaml").read_text()
    out = cli("config", "grpo_arithmetic", "mine", cwd=tmp_path)
    assert out.returncode == 2 and "mine exists and is not empty" in out.stderr


def _pins(path: Path) -> dict[str, str]:
    """name -> the text after it, for each requirement line of ``path`` (comments and -r lines left out)."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            name = _name(line)
            pins[name] = line[len(name):].strip()
    return pins


def test_the_recipe_requirements_pin_the_gpu_stack_exactly_and_cover_the_package():
    """``pip install -r requirements_gsm8k.txt`` is how the original recipe's users install on GPUs: every line is
    an exact version, the same as constraints/gpu.txt (the stack that was resolved together), and every dependency
    of the package is there (without ``gguf`` the default model cannot load; a ``>=`` would take the next vLLM and
    the torch it pins)."""
    import tomllib

    recipe, gpu = _pins(ROOT / "requirements_gsm8k.txt"), _pins(ROOT / "constraints" / "gpu.txt")
    assert all(spec.startswith("==") for spec in recipe.values()), recipe
    assert {name: spec for name, spec in recipe.items() if gpu.get(name) != spec} == {}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {_name(dep) for dep in project["dependencies"] + project["optional-dependencies"]["gpu"]}
    assert needed - set(recipe) == set()
    ifeval = _pins(ROOT / "requirements_ifeval.txt")
    assert all(spec.startswith("==") and gpu.get(name) == spec for name, spec in ifeval.items()), ifeval
    extra = {_name(dep) for dep in project["optional-dependencies"]["ifeval"]}
    assert extra - set(ifeval) == set()


def _name(requirement: str) -> str:
    """A requirement's package name, lower-case."""
    for mark in "=<>[ ;":
        requirement = requirement.split(mark)[0]
    return requirement.lower()


def test_the_async_script_takes_a_config_name_before_its_overrides(tmp_path):
    """``python grpo-async.py --config-name grpo_arithmetic key=value``: the async mode it adds joins the user's
    overrides (Hydra's parser takes them as one run of arguments), wherever the options stand."""
    from torchrl_grpo.run.cli import with_override

    assert with_override(["--config-name", "x", "a=1", "--cfg", "job"], "mode=async") == [
        "--config-name", "x", "mode=async", "a=1", "--cfg", "job"]
    assert with_override(["--cfg", "job"], "mode=async") == ["--cfg", "job", "mode=async"]
    script = Path(__file__).resolve().parents[1] / "grpo-async.py"
    shown = subprocess.run([sys.executable, str(script), "--config-name", "grpo_arithmetic", "model=tiny", "--cfg",
                            "job"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "\nmode: async\n" in shown.stdout and "exp_name: grpo-arithmetic" in shown.stdout
