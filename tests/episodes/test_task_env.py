"""Tasks as TorchRL environments (torchrl_grpo/episodes/task_env.py): single-turn rewards are the task's own for
the same completions, on every kind of task, and single-turn episodes, which skip the environment, are what it
gives; a TorchRL transform plugged by import path answers between turns and its message enters the ids token by
token; the upstream defect that makes us own the token insertion is pinned."""

import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict

from helpers import GSM8K, IFEVAL, ScriptedPolicy, cfg_with, needs_files, run
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.engines.base import Completion
from torchrl_grpo.episodes.play import play
from torchrl_grpo.episodes.setup import build_episode_task
from torchrl_grpo.episodes.task_env import TaskEnv, make_env
from torchrl_grpo.episodes.turn_envs import Turns
from torchrl_grpo.tasks import build_task


class FixedTexts:
    """Completion j of every prompt is ``texts[j]`` (its ids: the tokenizer's, then the turn's end)."""

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts = tokenizer, texts

    def generate(self, prompts, *, n, max_tokens, temperature, top_p, top_k=0, min_p=0.0):
        end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] + [end] for t in self.texts[:n]]
        return [Completion(i, ids[j], [-1.0] * len(ids[j]), "stop", t)
                for i in range(len(prompts)) for j, t in enumerate(self.texts[:n])]


TASKS = {
    "gsm8k": {"dataset": "gsm8k", "data_path": str(GSM8K), "split": "test"},
    "gsm_symbolic": {"dataset": "gsm_symbolic", "size": 8, "reasoning": True},
    "arithmetic": cfg_with("env=arithmetic").env,
    "reasoning_gym": {"dataset": "reasoning_gym", "tasks": ["syllogism", "leg_counting"], "size": 4, "seed": 3},
    "ifeval": {"dataset": "ifeval", "data_path": str(IFEVAL / "input_data.jsonl")},
    "custom_rewards": {"dataset": "gsm_symbolic", "size": 8, "rewards": [
        {"_target_": "test_task_env.shouting", "weight": 2.0}]},
}


def shouting(completion: str, row) -> float:
    """A custom reward named by import path (this module's)."""
    return float(completion.isupper())


@needs_files(GSM8K, IFEVAL)
@pytest.mark.parametrize("name", TASKS)
def test_single_turn_rewards_are_the_tasks_own_for_the_same_completions(name, tokenizer):
    task = build_task(OmegaConf.create(TASKS[name]))
    rows = [task.rows[i] for i in range(3)]
    gold = rows[0].get("answer", "none")
    texts = [f"<think>so</think><answer>{gold}</answer>\n#### {gold}",
             "#### 7", "THE ANSWER IS, WITHOUT A DOUBT: 12.", ""]
    played, _ = play(FixedTexts(tokenizer, texts), tokenizer, task, rows, n=len(texts), max_tokens=32,
                     temperature=1.0, top_p=1.0, max_model_len=None)
    for i, p in enumerate(played):
        expected = task.score(texts[i % len(texts)], rows[i // len(texts)])
        assert p.components == expected and list(p.components) == task.reward_names
        assert p.episode.turns == 1 and p.ended == "max_steps"
    assert any(task.total(p.components) > 0 for p in played) or name == "ifeval"
    # single-turn episodes skip the environment: through it (a transform that changes nothing sends them
    # there) they are the same, id for id and field for field
    through_env = Turns(transforms=({"_target_": "test_task_env.unchanged"},))
    in_env, _ = play(FixedTexts(tokenizer, texts), tokenizer, task, rows, n=len(texts), max_tokens=32,
                     temperature=1.0, top_p=1.0, max_model_len=None, turns=through_env)
    assert in_env == played


def unchanged():
    """A TorchRL transform that changes nothing."""
    from torchrl.envs import Transform

    return Transform()


def calculator():
    """A TorchRL tool transform (history mode): ``<tool>add\\n{"a": 2, "b": 3}</tool>`` answers 5."""
    from torchrl.envs.llm.transforms.tools import SimpleToolTransform

    return SimpleToolTransform(tools={"add": lambda a, b: a + b})


CALL = '<tool>add\n{"a": 2, "b": 3}</tool>'


def test_a_torchrl_tool_transform_plugged_by_import_path_answers_token_by_token(tokenizer):
    task, turns = build_episode_task({"dataset": "gsm_symbolic", "size": 4, "max_steps": 3,
                                      "transforms": [{"_target_": "test_task_env.calculator"}]})
    assert turns.env is None and turns.max_turns == 3
    policy = ScriptedPolicy(tokenizer, [CALL, "#### 5"])
    played, _ = play(policy, tokenizer, task, [task.rows[0]], n=2, max_tokens=32, temperature=1.0, top_p=1.0,
                     max_model_len=None, turns=turns)
    p = played[0]
    assert [m["role"] for m in p.conversation][-3:] == ["assistant", "tool", "assistant"]
    assert "5" in p.conversation[-2]["content"] and p.ended == "answer" and p.episode.turns == 2
    text = tokenizer.apply_chat_template(p.conversation, tokenize=False, add_generation_prompt=False)
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert p.episode.tokens == whole[: len(p.episode.tokens)]  # the tool's message entered as the template has it
    assert sum(p.episode.sampled) == len(tokenizer(CALL + "#### 5", add_special_tokens=False)["input_ids"]) + 2


@pytest.mark.parametrize("transforms, message", [
    ([{"_target_": "no_such_module.Tool"}], r"env.transforms\[0\]._target_=no_such_module.Tool: cannot import it"),
    ([{"_target_": "collections.OrderedDict"}], r"gave a OrderedDict, not a torchrl Transform"),
    ([{"weight": 1}], r"env.transforms\[0\]: give the transform's class or factory's import path as _target_"),
])
def test_bad_transforms_are_one_line_errors(transforms, message):
    with pytest.raises(ConfigError, match=message):
        build_episode_task({"dataset": "gsm_symbolic", "size": 4, "max_steps": 2, "transforms": transforms})


def test_the_task_env_is_a_torchrl_env_with_the_prompt_ids_and_the_conversation(tokenizer):
    from torchrl.envs import EnvBase

    task = build_task({"dataset": "gsm_symbolic", "size": 4, "system_prompt": "Be brief."})
    env = make_env(task, Turns(), tokenizer, max_tokens=8, max_model_len=None)
    assert isinstance(env.base_env, TaskEnv) and isinstance(env.base_env, EnvBase)
    from tensordict import NonTensorData

    state = env.reset(TensorDict({"row": NonTensorData(task.rows[0], batch_size=(1,))}, batch_size=(1,)))
    expected = tokenizer.apply_chat_template(task.messages(task.rows[0]), tokenize=False, add_generation_prompt=True)
    assert state["tokens", "prompt"][0].tolist() == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert list(state["history"].prompt[0].role) == ["system", "user"] and not state["done"].any()


def test_upstream_chat_env_in_tokens_mode_inserts_nothing_between_turns(tokenizer):
    """Pinned defect (torchrl 0.14): ChatEnv(input_mode="tokens").step makes the next prompt the sampled ids alone,
    with no user/tool turn and no generation prompt after them, so a second turn cannot be sampled from it; the
    history mode renders the conversation to text and tokenizes it again instead (not the sampled ids). Hence our
    InsertedTokens. When this fails, upstream changed: see whether ChatEnv can replace TaskEnv."""
    from tensordict import set_list_to_stack
    from torchrl.envs.llm import ChatEnv
    from torchrl.modules.llm.policies import Tokens

    with set_list_to_stack(True):
        env = ChatEnv(input_mode="tokens", batch_size=(1,), tokenizer=tokenizer)
        td = env.reset(TensorDict({"query": "What is 2+2?"}, batch_size=(1,)))
        prompt = td.get(("tokens", "prompt"), as_list=True)[0]
        response = torch.tensor(tokenizer("4", add_special_tokens=False)["input_ids"] +
                                [tokenizer.convert_tokens_to_ids("<|im_end|>")])
        full = torch.cat([prompt, response])
        td["tokens"] = Tokens(prompt=[prompt], response=[response], full=[full], batch_size=(1,))
        following = env.step(td).get(("next", "tokens", "prompt"), as_list=True)[0]
    assert following.tolist() == full.tolist()
    assert not tokenizer.decode(following).endswith("<|im_start|>assistant\n")


def test_a_bad_import_path_is_one_line_on_the_command_line(tmp_path):
    done = run(["model=tiny", "env=gsm_symbolic", "env.max_steps=2", "env.turn_env={_target_: nope.Env}"], cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "error: env.turn_env._target_=nope.Env: cannot import it; check the module is on PYTHONPATH and the name"]
