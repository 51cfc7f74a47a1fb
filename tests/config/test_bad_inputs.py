"""Bad input, one table: each row is a user's mistake (a config value, a file or folder it points at) and the
one-line error it must give, naming the key or the file, before the batch plan and before any model or
engine is built. In-process rows go through ``torchrl_grpo.run.build.read_inputs`` (what ``grpo.py`` reads first, in
order: the config, the checkpoint, the task's data and rewards, the model folder and its tokenizer); a few
go through a real ``grpo.py`` / ``evaluate.py`` to show the whole path: exit code 2, one line on stderr, no
traceback, no batch plan on stdout."""
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from helpers import CONFIG_DIR, cfg_with, run
from torchrl_grpo.config.command_line import check_overrides
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.run.build import read_inputs

GSM = ["model=tiny", "env=gsm_symbolic", "env.size=16"]  # a valid base: each row breaks one thing


def args(overrides: list[str], files: Path) -> list[str]:
    """The base and a row's overrides (a row that picks its own env= keeps only the tiny model of the base)."""
    base = ["model=tiny"] if any(o.startswith("env=") for o in overrides) else GSM
    return [*base, *(o.replace("{F}", str(files)) for o in overrides)]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_model_path) -> Path:
    """The broken files and folders the rows point at, made once."""
    root = tmp_path_factory.mktemp("bad_inputs")

    def model(name: str, config: str | None = None, weights: bytes | None = None) -> None:
        folder = root / name
        shutil.copytree(tiny_model_path, folder)
        if config is not None:
            (folder / "config.json").write_text(config)
        if weights is not None:
            (folder / "model.safetensors").write_bytes(weights)

    (root / "empty_model").mkdir()
    model("broken_config", config="{broken")
    model("not_a_model_config", config=json.dumps({"hello": 1}))
    model("custom_code", config=json.dumps({**json.loads((Path(tiny_model_path) / "config.json").read_text()),
                                           "auto_map": {"AutoConfig": "evil.EvilConfig"}}))
    model("truncated_weights", weights=(Path(tiny_model_path) / "model.safetensors").read_bytes()[:1000])
    (root / "empty.jsonl").write_text("")
    (root / "not_json.jsonl").write_text("{not json\n")
    (root / "binary.jsonl").write_bytes(bytes(range(128, 256)))
    (root / "wrong_schema.jsonl").write_text(json.dumps({"foo": 1}) + "\n")
    (root / "a_list.jsonl").write_text("[1, 2]\n")
    (root / "data.txt").write_text("question,answer\n")
    (root / "no_data_here").mkdir()
    corrupted = root / "run" / "checkpoints" / "step_000001"
    corrupted.mkdir(parents=True)
    (corrupted / "trainer_state.pt").write_bytes(b"not a pickle")
    pickled = root / "pickled" / "step_000001"  # an object weights_only refuses (numpy's RNG state)
    shutil.copytree(tiny_model_path, pickled)
    torch.save({"step": 1, "rng": __import__("numpy").random.get_state()}, pickled / "trainer_state.pt")
    return root


# (overrides, the start of the one-line error as a regex; {F} is the files folder)
ROWS = [
    # each key's kind and range (schema.py)
    (["train.seed=abc"], r"train.seed='abc': must be an integer"),
    (["env.seed=x"], r"env.seed='x': must be an integer"),
    (["env.num_envs=1.5"], r"env.num_envs=1.5: must be a positive integer"),
    (["env.num_envs=0"], r"env.num_envs=0: must be a positive integer"),
    (["env.repeats=-1"], r"env.repeats=-1: must be a positive integer"),
    (["train.total_dialog_turns=0"], r"train.total_dialog_turns=0: must be a positive integer"),
    (["logging.checkpoint_frequency=-1"], r"logging.checkpoint_frequency=-1: must be an integer >= 0"),
    (["train.kl_to_ref_coeff=-0.1"], r"train.kl_to_ref_coeff=-0.1: must be a number >= 0"),
    (["train.entropy_coeff=true"], r"train.entropy_coeff=True: must be a number >= 0"),
    (["optimizer.lr=0"], r"optimizer.lr=0: must be a number > 0"),
    (["optimizer.lr=abc"], r"optimizer.lr='abc': must be a number > 0"),
    (["inference_model.gpu_memory_utilization=1.5"],
     r"inference_model.gpu_memory_utilization=1.5: must be auto or a number in \(0, 1\]"),
    (["train.sync_iter=maybe"], r"train.sync_iter='maybe': must be true or false"),
    # what ray.streaming does not stream
    (["mode=async", "ray.streaming=true", "inference_model.backend=transformers"],
     r"inference_model.backend=transformers with ray.streaming=true: .*; set inference_model.backend=vllm or "
     r"ray.streaming=false"),
    (["mode=async", "ray.streaming=true", "loss.dynamic_sampling=true"],
     r"loss.dynamic_sampling=true with ray.streaming=true: .*; set loss.dynamic_sampling=false or ray.streaming=false"),
    (["mode=async", "ray.streaming=true", "env.max_steps=2"], r"ray.streaming=true plays single-turn episodes"),
    (["train.mixed_precision=maybe"],
     r"train.mixed_precision='maybe': choose auto \(bf16 autocast where bf16 is native\), true or false"),
    (["model.trust_remote_code=yes please"], r"model.trust_remote_code='yes please': must be true or false"),
    (["optimizer.name=Lion"], r"optimizer.name='Lion': choose one of AdamW, Adam, SGD"),
    (["loss.tis_cap=0"], r"loss.tis_cap=0: must be a number > 0 \(e.g. 2\), or null to turn TIS off"),
    (["loss.off_policy_mask_threshold=-1"], r"loss.off_policy_mask_threshold=-1: must be a number > 0 \(e.g. 0.5\)"),
    (["optimizer.clip_grad_norm=-1"], r"optimizer.clip_grad_norm=-1: must be > 0, or null for no clipping"),
    (["eval.temperature=-1"], r"eval.temperature=-1: must be a number >= 0 \(0 = greedy\)"),
    (["~train.epochs"], r"train.epochs is missing from the config"),
    (["+train.learning_rate=1e-5"], r"train.learning_rate: unknown key"),
    (["+wandb_api_key=abc"], r"wandb_api_key: unknown config section"),
    (["train_model.lora.enabled=true", "train_model.lora.r=0"], r"train_model.lora.r=0: must be a positive integer"),
    # combinations (config.py)
    (["train.optim_batch_size=5"], r"train.optim_batch_size=5 does not divide"),
    (["train.optim_batch_size=4", "train.gradient_accumulation_steps=3"], r"train.gradient_accumulation_steps=3"),
    (["train.dialog_turns_per_batch=10"], r"train.dialog_turns_per_batch=10"),
    (["inference_model.top_p=0.9", "loss.old_log_probs=engine"],
     r"inference_model.top_p=0.9 with loss.old_log_probs=engine: "),
    (["inference_model.top_k=20", "loss.old_log_probs=engine"],
     r"inference_model.top_k=20 with loss.old_log_probs=engine: "
     r".*set loss.old_log_probs=trainer \(or top_k=0\)"),
    (["inference_model.min_p=0.1", "loss.old_log_probs=engine"],
     r"inference_model.min_p=0.1 with loss.old_log_probs=engine"),
    (["inference_model.top_k=-1"], r"inference_model.top_k=-1: must be an integer >= 0"),
    (["env.max_steps=2"], r"env.max_steps=2 without env.turn_env: nothing answers between turns"),
    (["env=gsm_symbolic_python", "env.turn_env.memory_mb=-1"], r"env.turn_env.memory_mb=-1: must be a number > 0"),
    (["env=arithmetic", "env.split=valid"], r"env.split='valid': choose train or test"),
    (["train.total_dialog_turns=8"], r"train.total_dialog_turns=8 is fewer than the 16 completions of one step"),
    (["loss.aggregation=mean"], r"loss.aggregation='mean'"),
    (["train_model.num_devices=2", "inference_model.engine_process=same"],
     r"inference_model.engine_process=same with train.strategy=auto \(fsdp\): in rank 0's process vLLM"),
    # the model folder
    (["model.name=/no/such/model"], r"model.name='/no/such/model': no such directory"),
    (["model.name={F}/empty_model"], r"model.name='{F}/empty_model': the directory has no config.json"),
    (["loss=ppo", "critic.model={F}/empty_model"], r"critic.model='{F}/empty_model': the directory has no config.json"),
    (["loss=ppo", "critic.model={F}/gone"], r"critic.model='{F}/gone': no such directory"),
    (["model.name={F}/broken_config"], r"model.name={F}/broken_config: {F}/broken_config/config.json is not JSON"),
    (["model.name={F}/not_a_model_config"], r"model.name=.*/config.json is not a model config"),
    (["model.name={F}/custom_code"],
     r"model.name=.*asks to run the model folder's own Python code.*model.trust_remote_code"),
    (["model.name={F}/truncated_weights"],
     r"model.name={F}/truncated_weights: .*its weights do not load \(model.safetensors"),
    # the task's data and reward functions
    (["env=gsm8k", "env.data_path={F}/missing.jsonl"], r"env.data_path={F}/missing.jsonl: no such file or folder"),
    (["env=gsm8k", "env.data_path={F}/empty.jsonl"], r"env.data_path={F}/empty.jsonl: {F}/empty.jsonl is empty"),
    (["env=gsm8k", "env.data_path={F}/not_json.jsonl"], r"env.data_path={F}/not_json.jsonl: .* is not JSON lines"),
    (["env=gsm8k", "env.data_path={F}/binary.jsonl"], r"env.data_path={F}/binary.jsonl: .* is not JSON lines"),
    (["env=gsm8k", "env.data_path={F}/a_list.jsonl"], r"env.data_path={F}/a_list.jsonl: .* holds no JSON object"),
    (["env=gsm8k", "env.data_path={F}/wrong_schema.jsonl"],
     r"env.data_path=.*rows lack the column\(s\) \['question', 'answer'\]"),
    (["env=gsm8k", "env.data_path={F}/data.txt"], r"env.data_path={F}/data.txt: unsupported file type '.txt'"),
    (["env=gsm8k", "env.data_path={F}/no_data_here"], r"env.data_path={F}/no_data_here: none of train.jsonl"),
    (["env=ifeval", "env.data_path={F}/wrong_schema.jsonl"], r"env.data_path=.*rows lack the column\(s\) \['prompt'"),
    (["env=ifeval", "env.data_path={F}/empty.jsonl"], r"env.data_path={F}/empty.jsonl: {F}/empty.jsonl is empty"),
    (["env.dataset=nope"], r"env.dataset='nope': choose one of"),
    (["+env.rewards=[{_target_: no_such_module.length}]"],
     r"env.rewards\[0\]._target_=no_such_module.length: cannot import it"),
    (["+env.rewards=[{_target_: os.path.no_such_function}]"],
     r"env.rewards\[0\]._target_=os.path.no_such_function: cannot import"),
    (["+env.rewards=[{weight: 1}]"], r"env.rewards\[0\]: give the reward function's import path as _target_"),
    # the task's own env keys (its settings class) and the builder env._target_ names
    (["+env.tasks=[products]"], r"env.tasks: env.dataset=gsm_symbolic reads no such key; its own: data_path, "),
    (["+env.reasonning=true"], r"env.reasonning: env.dataset=gsm_symbolic reads no such key \(did you mean "
                                r"env.reasoning\?\)"),
    (["env.size=many"], r"env.size='many': must be an integer \(null: the default\)"),
    (["+env.eval.sise=5"], r"env.eval.sise: env.dataset=gsm_symbolic reads no such key \(did you mean env.eval.size"),
    (["env=custom"], r"env: give the task builder's import path as _target_ \(e.g. mypkg.tasks.build_my_task\)"),
    (["env=custom", "env._target_=no_such_pkg.tasks.build"],
     r"env._target_=no_such_pkg.tasks.build: cannot import it; check the module is on PYTHONPATH"),
    (["env=custom", "env._target_=os.path.join"], r"env._target_=os.path.join: 'join' is no task builder; decorate it"),
    # checkpoints to resume from
    (["train.resume={F}/no_such_run"], r"train.resume={F}/no_such_run: no checkpoint there"),
    (["train.resume={F}/run/checkpoints/step_000001"],
     r"train.resume=.*step_000001: that checkpoint does not load \(trainer_state.pt"),
    (["train.resume={F}/run"], r"train.resume={F}/run: none of its checkpoints loads"),
    (["train.resume={F}/pickled/step_000001"],
     r"train.resume=.*: that checkpoint does not load \(trainer_state.pt: Unpickling"),
    # lengths: the engine's context against the prompts and the model
    (["inference_model.max_model_len=8"], r"no env row fits inference_model.max_model_len=8: the shortest prompt has "
                                          r"\d+ tokens and a completion may take inference_model.max_tokens=24 more"),
    (["inference_model.max_model_len=4096"], r"inference_model.max_model_len=4096 is longer than the model's context "
                                             r"\(2048 tokens: max_position_embeddings in .*config.json\)"),
]


@pytest.mark.parametrize("overrides, expected", ROWS, ids=[" ".join(o) for o, _ in ROWS])
def test_a_bad_input_is_one_line_naming_it_before_any_work(overrides, expected, files, tmp_path):
    where = str(files)
    cfg = cfg_with(*args(overrides, files))
    with pytest.raises(ConfigError) as err:
        read_inputs(cfg, tmp_path)
    message = str(err.value)
    assert re.match(expected.replace("{F}", re.escape(where)), message), message
    assert "\n" not in message


def test_the_table_is_long_enough():
    assert len(ROWS) >= 30


def _refused(done) -> str:
    """The one line a refused script printed: exit code 2, nothing else on stderr, no batch plan on stdout."""
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-2000:]
    assert "batch plan" not in done.stdout and "completions per step" not in done.stdout
    return lines[0]


@pytest.mark.parametrize("overrides, expected", [
    (["train.seed=abc"], "error: train.seed='abc': must be an integer"),
    (["model.name={F}/broken_config"],
     "error: model.name={F}/broken_config: {F}/broken_config/config.json is not JSON"),
    (["env=gsm8k", "env.data_path={F}/empty.jsonl"], "error: env.data_path={F}/empty.jsonl: {F}/empty.jsonl is empty"),
    (["train.resume={F}/run/checkpoints/step_000001"], "error: train.resume={F}/run/checkpoints/step_000001: that "
                                                      "checkpoint does not load"),
    (["inference_model.max_model_len=8"], "error: no env row fits inference_model.max_model_len=8: "),
    (["+env.reasonning=true"], "error: env.reasonning: env.dataset=gsm_symbolic reads no such key (did you mean "),
])
def test_grpo_py_refuses_it_in_one_line_before_the_batch_plan(overrides, expected, files, tmp_path):
    done = run([*args(overrides, files), f"hydra.run.dir={tmp_path}/run"], tmp_path, timeout=120)
    assert _refused(done).startswith(expected.replace("{F}", str(files)))


@pytest.mark.parametrize("argv, expected", [
    (["train.no_such=1"], "Could not override 'train.no_such'. To append to your config use +train.no_such=1; check "
                          "the key's spelling"),
    (["model=nope"], "In 'grpo_gsm8k': Could not find 'model/nope' Available options in 'model': "
                     "qwen2.5-0.5b-instruct, "),
    (["--config-name", "nope"], "Cannot find primary config 'nope'"),
    (["optimizer.lr=[1"], "no viable alternative at input '[1'"),
    (["--multirun", "optimizer.lr=1e-4,1e-5", "model=nope"], "In 'grpo_gsm8k': Could not find 'model/nope'"),
])
def test_overrides_hydra_cannot_apply_are_one_line(argv, expected):
    with pytest.raises(ConfigError) as err:
        check_overrides(str(CONFIG_DIR), "grpo_gsm8k", argv)
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)


def test_valid_command_lines_pass_the_override_check():
    for argv in (["model=tiny", "--multirun", "optimizer.lr=1e-4,1e-5"], ["--config-name", "grpo_ifeval"],
                 ["+env.rewards=[{_target_: a.b}]", "hydra.run.dir=/tmp/x"], ["--help"],
                 ["mode=async", "ray.num_actors=2"]):
        check_overrides(str(CONFIG_DIR), "grpo_gsm8k", argv)


def test_grpo_py_refuses_a_misspelt_key_in_one_line(tmp_path):
    line = _refused(run(["model=tiny", "train.no_such=1", f"hydra.run.dir={tmp_path}/run"], tmp_path, timeout=120))
    assert line.startswith("error: Could not override 'train.no_such'")


def test_evaluate_py_refuses_a_bad_responses_file(files, tmp_path):
    done = run([*GSM, f"eval.responses={files}/not_json.jsonl", f"hydra.run.dir={tmp_path}/run"], tmp_path,
               script="evaluate.py", timeout=120)
    line = _refused(done)
    assert line.startswith(f"error: eval.responses={files}/not_json.jsonl: line 1 is not JSON")
