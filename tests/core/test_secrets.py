"""Secrets kept out of what a run writes (core/secrets.py): which values are secrets, how text, containers, log
records and the console are masked, and a real run whose prompts hold a secret, found nowhere in its run directory."""
import io
import json
import logging

from helpers import SMALL, run
from torchrl_grpo.core.secrets import MASK, Masker, MaskingFilter, MaskingStream, secret_values

SECRET = "sk-leak-0123456789abcdef"


def test_the_values_of_variables_named_as_secrets_longest_first():
    environ = {"WANDB_API_KEY": "w" * 40, "HF_TOKEN": "hf_" + "x" * 30, "DB_PASSWORD": "hunter2hunter2",
               "MY_SECRET": "s" * 12, "JUDGE_CREDENTIAL": "j" * 20, "TOKENIZERS_PARALLELISM": "false",
               "PATH": "/usr/bin:/bin:/usr/local/bin", "OPENAI_API_KEY": "short"}
    assert secret_values(environ) == ["w" * 40, "hf_" + "x" * 30, "hunter2hunter2", "s" * 12]
    assert "j" * 20 in secret_values(environ, names=["JUDGE_CREDENTIAL"])  # the judge's api_key_env


def test_text_containers_and_log_records_are_masked():
    masker = Masker(secret_values({"API_KEY": SECRET, "OTHER_TOKEN": "tok-" + SECRET}))
    assert masker.text(f"a tok-{SECRET} and {SECRET}.") == f"a {MASK} and {MASK}."
    tree = {"prompt": [f"say {SECRET}", ("x", 3)], "reward": 1.0, "nested": {"k": SECRET}}
    assert masker.tree(tree) == {"prompt": [f"say {MASK}", ("x", 3)], "reward": 1.0, "nested": {"k": MASK}}
    out = io.StringIO()
    logger = logging.getLogger("test_secrets")
    handler = logging.StreamHandler(out)
    handler.addFilter(MaskingFilter(masker))
    logger.addHandler(handler)
    try:
        logger.warning("key %s", SECRET)
        try:
            raise ValueError(f"bad key {SECRET}")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    assert SECRET not in out.getvalue() and out.getvalue().count(MASK) == 2
    console = io.StringIO()
    MaskingStream(console, masker).write(f"sample: {SECRET}\n")
    assert console.getvalue() == f"sample: {MASK}\n"


def test_a_secret_in_the_prompts_reaches_no_file_of_the_run(tmp_path):
    """The secret is in the environment under a secret's name, in the questions (so in every sample) and in the system
    prompt (so in the config and the checkpoints): each file of the run directory is read for it."""
    data, run_dir = tmp_path / "gsm8k", tmp_path / "run"
    data.mkdir()
    rows = [{"question": f"The key is {SECRET}. What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}
            for i in range(8)]
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    small = [arg for arg in SMALL if not arg.startswith(("env=", "env.size"))]
    out = run([*small, "env=gsm8k", f"env.data_path={data}", "inference_model.backend=transformers",
               "train.total_dialog_turns=16", "logging.samples_frequency=1", "logging.checkpoint_frequency=1",
               "logging.log_frequency=1", f"env.system_prompt=Remember-{SECRET}", f"hydra.run.dir={run_dir}"],
              cwd=tmp_path, env_extra={"MY_SERVICE_TOKEN": SECRET})
    assert out.returncode == 0, out.stderr[-2000:]
    assert SECRET not in out.stdout + out.stderr
    leaks = [str(p.relative_to(run_dir)) for p in run_dir.rglob("*")
             if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaks == []
    assert f"The key is {MASK}." in (run_dir / "samples.jsonl").read_text()  # the samples went through the mask
    assert f"Remember-{MASK}" in (run_dir / ".hydra" / "config.yaml").read_text()
    assert any((run_dir / "checkpoints").rglob("trainer_state.pt"))


def test_a_secret_in_a_completion_or_a_tool_reply_reaches_no_sample_file(tmp_path, monkeypatch):
    """What a policy prints or a tool replies goes to samples.jsonl (and the trackers' sample tables) through the
    same mask; the console's sample line too."""
    from helpers import cfg_with
    from torchrl_grpo.config.settings import LoggingSettings
    from torchrl_grpo.core import secrets
    from torchrl_grpo.telemetry.recorder import Telemetry

    monkeypatch.setattr(secrets.masker(), "secrets", [SECRET])
    settings = LoggingSettings.from_config(cfg_with("logging.progress_bar=false", "logging.samples_frequency=1"))
    sample = {"prompt": "What is the key?", "completion": f"The key is {SECRET}",
              "turns": [{"role": "tool", "content": f"printed {SECRET}\n"}], "reward": 1.0}
    with Telemetry(settings, {}, tmp_path, total_steps=1, start_step=0, resumed=False) as telemetry:
        telemetry.log(1, {"reward": 1.0}, [sample])
    written = (tmp_path / "samples.jsonl").read_text()
    assert SECRET not in written and written.count(MASK) == 2
    assert json.loads(written)["turns"][0]["content"] == f"printed {MASK}\n"
