"""env=verifiers on a verifiers (v1) taskset defined here (tests/vf_products: "What is a * 34?", a calculator
tool server, three weighted rewards and a metric): its rows and prompts, its scoring as the components, its tools
between the model's turns, its faults under env.reward_errors, one-line errors before any work, and grpo.py end
to end, single- and multi-turn."""
import importlib.util
import time

import pytest

from helpers import ROOT, SMALL, ScriptedPolicy, cfg_with, failure_excerpt, metric_rows, run
from torchrl_grpo.collect.collector import Collector
from torchrl_grpo.config.spec import resolve_run
from torchrl_grpo.core.errors import ConfigError, RunError
from torchrl_grpo.episodes.setup import build_episode_task
from torchrl_grpo.episodes.trajectories import PromptSampler

pytestmark = pytest.mark.needs("verifiers")

CALL = '<tool_call>{"name": "calculator_multiply", "arguments": {"a": 12, "b": 34}}</tool_call>'


def build(*overrides):
    return build_episode_task(cfg_with("model=tiny", "env=verifiers", "env.id=vf_products", *overrides).env)


def test_the_tasksets_tasks_are_the_rows_and_its_weights_the_components():
    task, turns = build("env.taskset={num_tasks: 3, first: 20}")
    assert task.rows["question"] == ["What is 20 * 34?", "What is 21 * 34?", "What is 22 * 34?"]
    assert task.rows["answer"] == ["680", "714", "748"] and task.rows["a"] == [20, 21, 22]  # the data's own field
    assert task.reward_weights == {"brief": 0.5, "correct": 1.0, "used_calculator": 0.25, "turns": 0.0}
    assert task.success_reward == "correct"  # the heaviest reward
    system, user = task.messages(task.rows[1])
    assert user == {"role": "user", "content": "What is 21 * 34?"}
    assert system["content"].startswith("Answer with the number.\n\nYou can call these tools.")
    assert '{"name": "calculator_multiply", "description": "Multiply two integers."' in system["content"]
    assert type(turns.env).__name__ == "VerifiersTools" and turns.max_turns == 4
    single, turns = build("env.max_steps=1", "env.turn_env=null", "env.size=2", "env.system_prompt=Be brief.")
    assert single.messages(single.rows[0]) == [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "What is 12 * 34?"}]  # no tools: one turn
    assert len(single) == 2 and turns.env is None


def test_each_completion_is_scored_by_the_task_and_each_component_logged_apart():
    task, _ = build("env.max_steps=1", "env.turn_env=null")
    rows = [task.rows[0], task.rows[0], task.rows[1]]  # 12 * 34 = 408 twice, then 13 * 34 = 442
    long = "I believe that the product is 408, as I computed by hand."
    scores = task.score_batch(["408", long, "408"], rows)
    assert scores == [{"brief": 1.0, "correct": 1.0, "used_calculator": 0.0, "turns": 1.0},
                      {"brief": 0.0, "correct": 1.0, "used_calculator": 0.0, "turns": 1.0},
                      {"brief": 1.0, "correct": 0.0, "used_calculator": 0.0, "turns": 1.0}]
    assert [task.total(s) for s in scores] == [1.5, 1.0, 0.5]  # 1 * correct + 0.5 * brief (+ 0.25 * tools)
    assert not task.env.scores  # every scoring read by all its components, then forgotten
    heavier, _ = build("env.max_steps=1", "env.turn_env=null", "env.reward_weights={brief: 2}", "env.success=brief")
    assert heavier.total(heavier.score("408", heavier.rows[0])) == 3.0 and heavier.success_reward == "brief"


def test_tool_calls_run_on_the_tasks_tool_server_and_the_episode_is_scored_whole():
    task, turns = build()
    row, prompt = task.rows[0], task.messages(task.rows[0])
    reply = turns.env.step(task, row, [*prompt, {"role": "assistant", "content": f"Let me compute. {CALL}"}])
    assert reply.messages == [{"role": "tool", "content": "408"}] and not reply.done
    assert reply.counts == {"tool_calls": 1, "tool_errors": 0}
    bad = turns.env.step(task, row, [*prompt, {"role": "assistant", "content": "<tool_call>{oops</tool_call> "
                                               '<tool_call>{"name": "abacus", "arguments": {}}</tool_call>'}])
    assert bad.counts == {"tool_calls": 2, "tool_errors": 2}
    assert bad.messages[0]["content"].startswith("error: the tool call is not JSON")
    assert bad.messages[1]["content"] == "error: no tool named 'abacus'; the tools are calculator_multiply"
    wrong_args = turns.env.step(task, row, [*prompt, {"role": "assistant", "content": CALL.replace("12", '"x"')}])
    assert wrong_args.counts["tool_errors"] == 1 and "error" in wrong_args.messages[0]["content"].lower()
    assert turns.env.step(task, row, [*prompt, {"role": "assistant", "content": "408"}]).done  # no call: the answer
    conversation = [*prompt, {"role": "assistant", "content": CALL}, *reply.messages,
                    {"role": "assistant", "content": "408"}]
    assert turns.env.score(task, row, conversation, 2) == {"brief": 1.0, "correct": 1.0, "used_calculator": 1.0,
                                                           "turns": 2.0}


def test_a_collected_episode_calls_the_tool_reads_its_result_and_earns_every_reward(tokenizer):
    policy = ScriptedPolicy(tokenizer, [CALL, "408"])
    cfg = cfg_with("model=tiny", "env=verifiers", "env.id=vf_products", "env.size=1", "env.num_envs=1",
                   "env.repeats=2", "train.optim_batch_size=2", "inference_model.max_tokens=64")
    task, turns = build_episode_task(cfg.env)
    c = Collector(task, tokenizer, policy, PromptSampler(1, seed=0), resolve_run(cfg).collect, turns)
    groups, stats = c.sample_groups()
    batch, metrics, _ = c.collect(0, (groups, stats))
    episode = groups[0].episodes[0]
    assert [m["role"] for m in episode.conversation[1:]] == ["user", "assistant", "tool", "assistant"]
    assert episode.conversation[3]["content"] == "408" and episode.ended == "answer"
    assert batch["reward"].tolist() == [1.75, 1.75] and metrics["turns/tool_calls"] == 1
    assert metrics["reward/used_calculator"] == 1.0 and metrics["reward/turns"] == 2.0


def test_a_reward_that_raises_stops_the_run_or_scores_zero_as_env_reward_errors_says():
    task, _ = build("env.max_steps=1", "env.turn_env=null", "env.taskset={task: {raise_on: 12}}")
    with pytest.raises(RunError, match=r"reward '\w+' .* raised TaskError: task ProductTask scoring: "
                                      r"RuntimeError: no product for this one on the row whose prompt starts"):
        task.score("408", task.rows[0])
    task, _ = build("env.max_steps=1", "env.turn_env=null", "env.taskset={task: {raise_on: 12}}",
                    "env.reward_errors=zero")
    assert task.score("408", task.rows[0])["correct"] == 0.0 and task.reward_error_count == 4  # all of its scoring
    assert task.score("442", task.rows[1])["correct"] == 1.0


def test_a_scoring_that_never_returns_stops_at_env_timeout_s_as_env_reward_errors_says():
    task, _ = build("env.max_steps=1", "env.turn_env=null", "env.taskset={task: {hang_on: 12}}", "env.timeout_s=1")
    t0 = time.perf_counter()
    with pytest.raises(RunError, match=r"reward '\w+' .* raised TimeoutError: the task's scoring timed out after 1 s "
                                      r"\(env.timeout_s\) on the row whose prompt starts"):
        task.score("408", task.rows[0])
    assert time.perf_counter() - t0 < 10
    task, _ = build("env.max_steps=1", "env.turn_env=null", "env.taskset={task: {hang_on: 12}}", "env.timeout_s=1",
                    "env.reward_errors=zero")
    assert task.score("408", task.rows[0])["correct"] == 0.0 and task.reward_error_count == 4
    assert task.score("442", task.rows[1])["correct"] == 1.0


def test_bad_input_is_one_line_before_any_work(monkeypatch):
    with pytest.raises(ConfigError, match=r"^env.id=None: name the verifiers environment"):
        build_episode_task(cfg_with("env=verifiers").env)
    with pytest.raises(ConfigError, match=r"^env.id=no_such_env: loading its taskset failed \(ModuleNotFoundError: "
                                          r"taskset 'no_such_env' not found.*\); "
                                          r"install the environment's package, or check env.id$"):
        build("env.id=no_such_env")
    with pytest.raises(ConfigError, match=r"^env.taskset: num_tasks: Input should be a valid integer, unable to parse "
                                          r"string as an integer \(the config of taskset vf_products\)$"):
        build("env.taskset={num_tasks: many}")
    with pytest.raises(ConfigError, match=r"^env.success='turns': not one of the task's rewards"):
        build("env.success=turns")
    with pytest.raises(ConfigError, match=r"^env.size=0: must be an integer >= 1"):
        build("env.size=0")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "verifiers" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^env.dataset=verifiers: the verifiers package is not installed; "
                                          r"pip install -e \"\.\[verifiers\]\" \(on the CPU stack: "):
        build()


@pytest.mark.parametrize("turns", [["env.max_steps=1", "env.turn_env=null"], []], ids=["single_turn", "tool_turns"])
def test_grpo_py_trains_on_a_verifiers_taskset(turns, tmp_path):
    run_dir = tmp_path / "run"
    args = [*SMALL, "env=verifiers", "env.id=vf_products", *turns, "inference_model.backend=transformers",
            "inference_model.max_tokens=16", "train.total_dialog_turns=16", "logging.eval_frequency=2",
            "eval.num_prompts=2", f"hydra.run.dir={run_dir}"]
    done = run(args, cwd=tmp_path, env_extra={"PYTHONPATH": str(ROOT / "tests")})
    assert done.returncode == 0, failure_excerpt(done)
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == ["0", "1", "2"]
    assert all(r["reward/brief"] != "" and r["reward/turns"] != "" for r in rows[1:])
    assert float(rows[-1]["eval/prompts"]) == 2 and "reward/correct" in done.stdout


def test_tool_servers_that_do_not_start_are_one_line_or_an_error_the_model_reads(monkeypatch):
    import vf_products

    async def broken(self):
        raise OSError("port in use")

    monkeypatch.setattr(vf_products.Calculator, "setup", broken)
    with pytest.raises(ConfigError, match=r"^env.id=vf_products: starting its tool servers failed \(OSError: port in "
                                          r"use\)$"):
        build()
    task, turns = build("env.max_steps=1", "env.turn_env=null")  # one turn: no tools started
    reply = task.env.call_tools(0, CALL)  # what a turn environment would get if they failed later
    assert [(r.content, r.error) for r in reply] == [("error: the tools are not available (OSError: port in use)",
                                                      True)]
