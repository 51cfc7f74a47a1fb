"""Multi-turn episodes through the collector (torchrl_grpo/episodes/play.py's play, torchrl_grpo/episodes/turn_envs.py):
a scripted policy (fixed ids per turn) with the Python tool and with retry feedback. The batch must hold exactly the
sampled ids and the inserted ones, in order, the loss mask exactly the sampled ids, the engine's log-probs at their
places; rewards, ending reasons and per-turn metrics as the script implies. Then a real engine: the trainer's
log-probs of a played batch are the engine's at every sampled id, later turns included."""
import datasets
import pytest
import torch

from helpers import (
    LOGPROB_TOL,
    SMALL,
    ScriptedPolicy,
    cfg_with,
    finite,
    metric_rows,
    needs_ray_and_vllm,
    needs_vllm,
    ray_processes,
    rendered,
    run,
    run_async,
)
from torchrl_grpo.collect.collector import Collector
from torchrl_grpo.config.spec import resolve_run
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.core.secrets import masker
from torchrl_grpo.engines.factory import make_engine
from torchrl_grpo.episodes.setup import build_episode_task
from torchrl_grpo.episodes.trajectories import PromptSampler
from torchrl_grpo.episodes.turn_envs import PythonTool, Reply, RetryFeedback, Turns, python_call
from torchrl_grpo.objective.log_probs import token_log_probs
from torchrl_grpo.tasks import Reward, Task

CALL = "```python\nprint(6 * 7)\n```"
SECRET = "sk-leak-0123456789abcdef"


def answer_42(completion, row):
    return float(completion.strip().endswith("#### 42"))


def collector(tokenizer, engine, turn_env, max_steps=3, max_model_len=2048):
    cfg = cfg_with("model=tiny", "env.num_envs=2", "env.repeats=2", "train.optim_batch_size=4",
                   "inference_model.max_tokens=16", f"inference_model.max_model_len={max_model_len}")
    rows = datasets.Dataset.from_dict({"question": ["What is 6 x 7?", "Six times seven?"], "answer": ["42", "42"]})
    task = Task("x", rows, "Use the tool.", [Reward("accuracy", answer_42)])
    return Collector(task, tokenizer, engine, PromptSampler(2, seed=0), resolve_run(cfg).collect,
                     Turns(max_steps, turn_env))


def test_a_tool_call_episode_holds_the_sampled_and_inserted_ids_exactly(tokenizer):
    policy = ScriptedPolicy(tokenizer, [CALL, "#### 42"])
    c = collector(tokenizer, policy, PythonTool())
    groups, stats = c.sample_groups()
    batch, metrics, samples = c.collect(0, (groups, stats))
    texts = [s["completion"] for s in samples]
    played = groups[0].episodes[0]
    assert played.conversation[-2] == {"role": "tool", "content": "42"}
    assert [m["role"] for m in played.conversation] == ["system", "user", "assistant", "tool", "assistant"]
    assert played.ended == "answer" and played.counts == {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0}
    # the ids are what the whole conversation renders to (up to the end of the last sampled turn)
    whole = rendered(tokenizer, played.conversation)
    row = batch["tokens"][0][batch["attention_mask"][0]].tolist()
    assert row == whole[: len(row)] and tokenizer.decode(whole[len(row):]) == "\n"
    # the loss mask is exactly the two sampled turns, their log-probs at their places, 0 elsewhere
    turn_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [policy.end] for t in (CALL, "#### 42")]
    mask = batch["completion_mask"][0]
    assert [row[i] for i in mask.nonzero().flatten()] == turn_ids[0] + turn_ids[1]
    first, second = mask.nonzero().flatten().split([len(turn_ids[0]), len(turn_ids[1])])
    assert int(second[0]) - int(first[-1]) > 1  # the tool's turn lies between them, masked
    lp = batch["sample_log_probs"][0]
    assert torch.allclose(lp[first], torch.tensor([-0.1 - 0.001 * k for k in range(len(first))]))
    assert torch.allclose(lp[second], torch.tensor([-0.2 - 0.001 * k for k in range(len(second))]))
    assert (lp[~mask] == 0).all()
    inserted = [row[i] for i in range(int(first[-1]) + 1, int(second[0]))]
    assert tokenizer.decode(inserted) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert batch["reward"].tolist() == [1.0] * 4 and not batch["truncated"].any()
    assert metrics["turns/engine_turns"] == 2 and metrics["turns/tool_calls"] == 1
    assert metrics["turns/inserted_tokens"] == len(inserted) and metrics["turns/ended_answer"] == 1
    assert metrics["env_time"] > 0 and "<|im_start|>tool\n42" in texts[0]
    # turn 1: one request per prompt with n episodes; turn 2: one per episode
    assert policy.calls[:2] == [(2, 2), (4, 1)]


class LeakyTool(RetryFeedback):
    """A tool written carelessly: its reply holds the trainer's API key."""

    def step(self, task, row, conversation):
        return Reply([{"role": "tool", "content": f"OPENAI_API_KEY={SECRET}"}])


def test_a_secret_in_a_tool_reply_never_reaches_the_model(tokenizer, monkeypatch):
    """With the run's masks on, a tool's reply is masked before it joins the conversation: the tokens the model
    reads next (and the batch, and the samples) hold *** in its place."""
    monkeypatch.setattr(masker(), "secrets", [SECRET])
    c = collector(tokenizer, ScriptedPolicy(tokenizer, [CALL, "#### 42"]), LeakyTool(), max_steps=2)
    groups, stats = c.sample_groups()
    batch, _, samples = c.collect(0, (groups, stats))
    assert groups[0].episodes[0].conversation[-2] == {"role": "tool", "content": "OPENAI_API_KEY=***"}
    ids = batch["tokens"][0][batch["attention_mask"][0]].tolist()
    assert "OPENAI_API_KEY=***" in tokenizer.decode(ids) and SECRET not in tokenizer.decode(ids)
    assert not any(SECRET in str(s) for s in samples)


def test_episodes_end_at_max_steps_at_a_cut_turn_and_before_the_context_is_full(tokenizer):
    calls_only = collector(tokenizer, ScriptedPolicy(tokenizer, [CALL] * 3), PythonTool(), max_steps=3)
    batch, metrics, _ = calls_only.collect(version=0)
    assert metrics["turns/engine_turns"] == 3 and metrics["turns/tool_calls"] == 2
    assert metrics["turns/ended_max_steps"] == 1 and batch["reward"].sum() == 0
    cut = collector(tokenizer, ScriptedPolicy(tokenizer, ["```python\nprint(6 *"], cut=[0]), PythonTool())
    batch, metrics, _ = cut.collect(version=0)
    assert metrics["turns/ended_length"] == 1 and metrics["turns/tool_calls"] == 0 and batch["truncated"].all()
    cut_call = collector(tokenizer, ScriptedPolicy(tokenizer, [CALL + " and", "#### 42"], cut=[0]), PythonTool())
    batch, metrics, _ = cut_call.collect(version=0)  # a whole call before the cut runs
    assert metrics["turns/tool_calls"] == 1 and metrics["turns/ended_answer"] == 1 and not batch["truncated"].any()
    prompt = cut.sample_groups()[0][0].episodes[0].prompt_length
    short = collector(tokenizer, ScriptedPolicy(tokenizer, [CALL, "#### 42"]), PythonTool(), max_model_len=prompt + 40)
    batch, metrics, _ = short.collect(version=0)
    assert metrics["turns/ended_context"] == 1 and metrics["turns/engine_turns"] == 1
    assert metrics["turns/tool_calls"] == 1  # the call ran; its output did not fit another turn


def test_retry_feedback_rewards_by_the_turn_that_got_it_right(tokenizer):
    c = collector(tokenizer, ScriptedPolicy(tokenizer, ["#### 41", "#### 40", "#### 42"]), RetryFeedback(discount=0.5))
    batch, metrics, samples = c.collect(version=0)
    texts = [s["completion"] for s in samples]
    assert {s["prompt"] for s in samples} <= set(c.task.rows["question"])  # the row's prompt, each completion
    assert batch["reward"].tolist() == [0.25] * 4 and metrics["reward/accuracy"] == 0.25
    assert metrics["turns/retries"] == 2 and metrics["turns/engine_turns"] == 3
    assert texts[0].count("Wrong, try again.") == 2
    right_away = collector(tokenizer, ScriptedPolicy(tokenizer, ["#### 42"]), RetryFeedback())
    batch, metrics, _ = right_away.collect(version=0)
    assert batch["reward"].tolist() == [1.0] * 4 and metrics["turns/engine_turns"] == 1
    never = collector(tokenizer, ScriptedPolicy(tokenizer, ["#### 1", "#### 2"]), RetryFeedback(), max_steps=2)
    batch, metrics, _ = never.collect(version=0)
    assert batch["reward"].tolist() == [0.0] * 4 and metrics["turns/ended_max_steps"] == 1
    cut = collector(tokenizer, ScriptedPolicy(tokenizer, ["#### 4", "#### 42"], cut=[0]), RetryFeedback())
    batch, metrics, samples = cut.collect(version=0)  # a cut answer is a wrong one: the end of its turn is inserted
    assert (batch["reward"].tolist() == [0.5] * 4
            and samples[0]["completion"].startswith("#### 4<|im_end|>\n<|im_start|>user\nWrong"))


def test_the_python_tool_reports_errors_and_timeouts_to_the_model():
    tool, task = PythonTool(timeout_s=1), None

    def step(text):
        return tool.step(task, {}, [{"role": "assistant", "content": text}])

    assert step("#### 3").done
    failing = step("```python\n1 / 0\n```")
    assert "ZeroDivisionError" in failing.messages[0]["content"] and failing.counts["tool_errors"] == 1
    endless = step("```python\nwhile True: pass\n```")
    assert "timed out" in endless.messages[0]["content"] and endless.counts["tool_timeouts"] == 1
    assert step("```python\nx = 1\n```").messages[0]["content"] == "(no output)"
    flood = PythonTool(max_output_chars=50).step(
        task, {}, [{"role": "assistant", "content": "```python\nprint('a' * 999)\n```"}])
    assert flood.messages[0]["content"].endswith("[output cut]") and len(flood.messages[0]["content"]) < 70
    assert python_call("a\n```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```") == "print(2)\n"
    assert python_call("```\nprint(1)\n```") is None


@pytest.mark.parametrize("env, message", [
    ({"max_steps": 3}, "env.max_steps=3 without env.turn_env"),
    ({"max_steps": 1, "turn_env": {"_target_": "torchrl_grpo.episodes.turn_envs.RetryFeedback"}}, "env.max_steps=1"),
    ({"max_steps": 2, "turn_env": {"_target_": "no_such.Env"}}, "env.turn_env._target_=no_such.Env: cannot import"),
    ({"max_steps": 2, "turn_env": {"_target_": "collections.OrderedDict"}}, "not a subclass"),
    ({"max_steps": 2, "turn_env": {"_target_": "torchrl_grpo.episodes.turn_envs.RetryFeedback", "colour": 1}},
     "colour"),
    ({"max_steps": 2, "turn_env": {"_target_": "torchrl_grpo.episodes.turn_envs.RetryFeedback", "discount": 2}},
     "env.turn_env.discount=2"),
    ({"max_steps": 2, "turn_env": {"_target_": "torchrl_grpo.episodes.turn_envs.PythonTool", "timeout_s": 0}},
     "env.turn_env.timeout_s=0"),
])
def test_bad_turn_env_settings_are_one_line_errors(env, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        build_episode_task({"dataset": "gsm_symbolic", "size": 5, **env})


def test_soft_overlong_is_refused_with_several_turns():
    from torchrl_grpo.config.validate import validate

    cfg = cfg_with("model=tiny", "loss=dapo", "env.max_steps=2",
                   "env.turn_env={_target_: torchrl_grpo.episodes.turn_envs.RetryFeedback}")
    with pytest.raises(ConfigError, match="loss.overlong=soft with env.max_steps=2"):
        validate(cfg)


def test_the_trainer_scores_every_sampled_id_of_a_played_episode_as_the_engine_did(tiny_model_path, tokenizer):
    """A real engine plays three-turn episodes (the tiny model never answers right, its turns are cut at max_tokens:
    every episode retries):
    the trainer's log-probs at the sampled ids of every turn equal the engine's, and nothing is scored elsewhere."""
    from torchrl_grpo.models.loading import load_policy

    engine = make_engine("transformers", tiny_model_path, seed=0)
    c = collector(tokenizer, engine, RetryFeedback(), max_steps=3)
    batch, metrics, _ = c.collect(version=0)
    assert metrics["turns/engine_turns"] == 3  # later turns were sampled after inserted feedback
    model = load_policy(tiny_model_path, dtype="float32", device="cpu", trainable=False)
    with torch.no_grad():
        ours, _ = token_log_probs(model, batch["tokens"], batch["attention_mask"], wanted=batch["completion_mask"])
    mask = batch["completion_mask"]
    assert (ours[~mask] == 0).all()
    assert (ours[mask] - batch["sample_log_probs"][mask]).abs().max() < LOGPROB_TOL


def test_evaluation_reports_tool_calls_per_episode(tokenizer):
    """Evaluation plays the episodes as training does and reports their turn metrics beside the accuracy: one
    call then the answer in every episode; an answer without a call in every other one."""
    from torchrl_grpo.config.settings import EvalSettings
    from torchrl_grpo.run.evaluation import evaluate_with_engine

    rows = datasets.Dataset.from_dict({"question": ["What is 6 x 7?", "Six times seven?"], "answer": ["42", "42"]})
    task = Task("x", rows, "Use the tool.", [Reward("accuracy", answer_42)])
    settings = EvalSettings(num_prompts=None, samples=2, temperature=1.0, max_tokens=16, max_model_len=2048, every=0)
    metrics, records = evaluate_with_engine(ScriptedPolicy(tokenizer, [CALL, "#### 42"]), task, tokenizer, settings,
                                            Turns(3, PythonTool()))
    assert metrics["accuracy"] == 1 and metrics["turns/tool_calls"] == 1 and metrics["turns/engine_turns"] == 2
    assert [r["response"] for r in records] == ["#### 42"] * 4
    direct, _ = evaluate_with_engine(ScriptedPolicy(tokenizer, ["#### 41"]), task, tokenizer, settings,
                                     Turns(3, PythonTool()))
    assert direct["accuracy"] == 0 and direct["turns/tool_calls"] == 0 and direct["turns/ended_answer"] == 1
    single, _ = evaluate_with_engine(ScriptedPolicy(tokenizer, ["#### 42"]), task, tokenizer, settings)
    assert single["accuracy"] == 1 and not any(k.startswith("turns/") for k in single)


@needs_vllm
def test_grpo_runs_the_python_tool_recipe_end_to_end(tmp_path):
    """The tool recipe as users start it, with the tiny model (the random tiny model seldom writes a call: this
    checks the wiring, the worked example, the sandbox starting and the multi-turn metrics in
    training and evaluation; the scripted tests above check the calls; docs/agentic.md what SmolLM2 learns)."""
    run_dir = tmp_path / "run"
    small = [arg for arg in SMALL if not arg.startswith("env=")]
    done = run(["--config-name", "grpo_python_tool", *small, "env.max_steps=3", "env.size=64",
                "train.total_dialog_turns=16", "logging.eval_frequency=2", "eval.num_prompts=4",
                f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    logged = metric_rows(run_dir)
    assert [int(float(r["step"])) for r in logged] == [0, 1, 2]  # step 0: the evaluation before training
    assert finite(logged[0]["eval/accuracy"]) and finite(logged[2]["eval/accuracy"])
    logged = logged[1:]
    for key in ("turns/engine_turns", "turns/tool_calls", "turns/tool_errors", "turns/tool_timeouts",
                "turns/inserted_tokens", "turns/ended_length", "env_time", "loss_objective"):
        assert all(finite(r[key]) for r in logged), key
    assert all(1 <= float(r["turns/engine_turns"]) <= 3 for r in logged)
    assert "| turns " in done.stdout and "| calls " in done.stdout
    assert finite(metric_rows(run_dir)[0]["eval/turns/tool_calls"]) and "eval at step 0: accuracy" in done.stdout
    assert (run_dir / "plots" / "turns.png").is_file()
    assert "print(12 * 34)" in (run_dir / ".hydra" / "config.yaml").read_text()  # the recipe's worked example


@needs_ray_and_vllm
def test_grpo_async_runs_retry_episodes_of_three_turns(tmp_path):
    """Ray rollout actors play the episodes: the tiny model is never right, so every episode takes its three
    turns, two of them after inserted feedback. The SAPO preset, with an entropy bonus so that every step updates."""
    run_dir = tmp_path / "run"
    done = run_async([*SMALL, "env=arithmetic_retry", "env.size=64", "train.total_dialog_turns=16", "loss=sapo",
                      "train.entropy_coeff=0.01", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    logged = metric_rows(run_dir)
    assert [int(float(r["step"])) for r in logged] == [1, 2]
    for r in logged:
        assert float(r["turns/engine_turns"]) == 3 and float(r["turns/retries"]) == 2
        assert float(r["turns/inserted_tokens"]) > 0 and finite(r["loss_objective"]) and float(r["grad_norm"]) > 0
    assert not ray_processes()
