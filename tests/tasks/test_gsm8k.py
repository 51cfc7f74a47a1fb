"""GSM8K task: answer extraction on the real data, rewards, loading (local, hub offline, gsm_symbolic), build_task."""
import dataclasses
import json
import re
import time

import pytest
from omegaconf import OmegaConf

from helpers import GSM8K, needs_files
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.tasks import TASK_BUILDERS, Task, build_task, register_task
from torchrl_grpo.tasks.gsm8k import (
    REASONING_SYSTEM_PROMPT,
    SYSTEM_PROMPT,
    accuracy,
    answer_format,
    extract_last_number,
    gold_answer,
    load_gsm8k,
    load_gsm_symbolic,
    normalize_number,
    think_format,
)

needs_data = needs_files(GSM8K / "train.jsonl", GSM8K / "test.jsonl")


def _read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------------------------------ real data
@needs_data
def test_extractor_agrees_with_gold_on_every_gsm8k_row():
    rows = _read_jsonl(GSM8K / "train.jsonl") + _read_jsonl(GSM8K / "test.jsonl")
    assert len(rows) == 8792
    bad = []
    for i, row in enumerate(rows):
        text = row["answer"]
        # independent reading of the gold: the text after "####", commas dropped (all GSM8K golds are integers)
        plain = text.split("####")[1].strip().replace(",", "")
        gold = gold_answer(text)
        if not (extract_last_number(text) == gold == plain):
            bad.append((i, text[-60:], extract_last_number(text), gold, plain))
        elif accuracy(text, {"answer": gold}) != 1.0 or accuracy(text, row) != 1.0 or answer_format(text) != 1.0:
            bad.append((i, text[-60:], "reward"))
    assert not bad, bad[:10]


# ------------------------------------------------------------------------------------------ hand cases
@pytest.mark.parametrize(
    "text, expected",
    [
        ("1,234", "1234"),
        ("It costs $5", "5"),
        ("-3", "-3"),
        ("the change is -3 degrees", "-3"),
        ("3.50", "3.5"),
        ("7.0", "7"),
        ("7.", "7"),
        (".5", "0.5"),
        ("about 0.50 of it", "0.5"),
        ("1,234,567", "1234567"),
        ("$1,234.50.", "1234.5"),
        ("The answer is 42.", "42"),
        ("So she has 3, 4", "4"),
        ("pick 3,4", "4"),
        ("from 10-20", "20"),
        ("x = -$5", "-5"),
        ("(-3)", "-3"),
        ("\u22127", "-7"),
        ("007", "7"),
        ("-0", "0"),
        ("48/2 = <<48/2=24>>24 clips\n#### 72", "72"),
        ("no number here", None),
        ("", None),
    ],
)
def test_extract_last_number(text, expected):
    assert extract_last_number(text) == expected


def test_normalize_and_gold():
    assert normalize_number("3.50") == normalize_number("3.5") == "3.5"
    assert normalize_number("1,080") == "1080"
    assert gold_answer("blah <<2*3=6>>6\n#### 1,080") == "1080"
    assert gold_answer("#### -4") == "-4"
    assert gold_answer("42") == "42"  # a bare answer (no ####) is its last number
    with pytest.raises(ValueError):
        gold_answer("#### none")


def test_accuracy():
    row = {"question": "q", "answer": "3.5"}
    assert accuracy("It is 3.50", row) == 1.0
    assert accuracy("#### 3.5", row) == 1.0
    assert accuracy("3.5 or maybe 4", row) == 0.0  # the LAST number counts
    assert accuracy("#### 3.5\nthen 12 more words", row) == 0.0
    assert accuracy("The answer is 1,234.", {"answer": "1234"}) == 1.0  # independent of format
    assert accuracy("$5", {"answer": "5"}) == 1.0
    assert accuracy("7.0", {"answer": "7"}) == 1.0
    assert accuracy("-3", {"answer": "3"}) == 0.0
    assert accuracy("3, 4", {"answer": "34"}) == 0.0
    assert accuracy("no idea", row) == 0.0
    assert accuracy("", row) == 0.0
    # a raw GSM8K answer field as the gold works too
    assert accuracy("#### 1080", {"answer": "so <<1+1=2>>2\n#### 1,080"}) == 1.0


@pytest.mark.parametrize("text", ["#### 42", "####42", "#### -3", "#### $1,080", "reasoning...\n#### 3.5 dollars",
                                  "x ####   7."])
def test_answer_format_positive(text):
    assert answer_format(text) == 1.0


@pytest.mark.parametrize("text", ["42", "The answer is 42.", "####", "#### forty", "## 42", "# 42", ""])
def test_answer_format_negative(text):
    assert answer_format(text) == 0.0


def test_think_format():
    assert think_format("<think>48/2 = 24, 48+24 = 72</think>\n#### 72") == 1.0
    assert think_format("  <think>\nstep\n</think>#### 5") == 1.0
    assert think_format("#### 72") == 0.0  # no think block
    assert think_format("<think>  </think>\n#### 72") == 0.0  # empty thoughts
    assert think_format("<think>so #### 72</think>") == 0.0  # answer only inside the thoughts
    assert think_format("<think>a</think>\nno answer") == 0.0
    assert think_format("#### 72 <think>a</think>") == 0.0  # answer before the thoughts
    assert think_format("<think>a</think><think>b</think>#### 72") == 0.0  # two blocks
    assert think_format("<think>never closed #### 72") == 0.0
    assert think_format("</think>a<think>#### 72") == 0.0


# ------------------------------------------------------------------------------------------ loading
@needs_data
def test_load_local_folder_and_single_jsonl():
    train = load_gsm8k(data_path=GSM8K)
    test = load_gsm8k(data_path=str(GSM8K), split="test")
    single = load_gsm8k(data_path=GSM8K / "test.jsonl")
    assert (len(train), len(test), len(single)) == (7473, 1319, 1319)
    assert {"question", "answer"} <= set(train.column_names)
    raw = _read_jsonl(GSM8K / "train.jsonl")[0]
    assert train[0]["question"] == raw["question"]
    assert train[0]["answer"] == gold_answer(raw["answer"]) == "72"
    assert single[0] == test[0]


@needs_data
def test_load_hub_layout_parquet_and_custom_jsonl(tmp_path):
    rows = _read_jsonl(GSM8K / "test.jsonl")[:20]
    import datasets

    (tmp_path / "main").mkdir()
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "main" / "test-00000-of-00001.parquet"))
    ds = load_gsm8k(data_path=tmp_path, split="test")
    assert len(ds) == 20 and ds[3]["answer"] == gold_answer(rows[3]["answer"])

    custom = tmp_path / "mine.jsonl"
    custom.write_text(
        json.dumps({"question": "q1", "answer": "#### 1,080", "id": 7})
        + "\n"
        + json.dumps({"question": "q2", "answer": "3.50"})
        + "\n"
    )
    ds = load_gsm8k(data_path=custom)
    assert list(ds["answer"]) == ["1080", "3.5"]
    assert list(ds["question"]) == ["q1", "q2"]


def test_load_errors(tmp_path):
    with pytest.raises(ConfigError, match="env.data_path"):
        load_gsm8k(data_path=tmp_path / "missing")
    with pytest.raises(ConfigError, match="env.data_path"):
        load_gsm8k(data_path=tmp_path)  # a folder without train.jsonl
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "q", "answer": "1"}) + "\n")
    with pytest.raises(ConfigError, match="question"):
        load_gsm8k(data_path=bad)
    with pytest.raises(ConfigError, match="env.split"):
        load_gsm8k(split="validation")


def test_hub_offline_raises_config_error_fast(monkeypatch):
    import datasets
    import huggingface_hub.constants

    # the libraries read HF_HUB_OFFLINE when imported, so patch their copies as well as the environment
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        build_task({"dataset": "openai/gsm8k"})
    elapsed = time.monotonic() - start
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("env.dataset=openai/gsm8k")
    assert "env.data_path=" in msg and "env=gsm_symbolic" in msg
    assert elapsed < 10, f"offline failure took {elapsed:.1f}s (retries?)"


def test_gsm_symbolic_rows_and_gold_accuracy():
    import reasoning_gym

    rows = load_gsm_symbolic(size=300, seed=5)
    assert len(rows) == 300 and rows.column_names == ["question", "answer"]
    assert list(rows["answer"]) == list(load_gsm_symbolic(size=300, seed=5)["answer"])  # seeded
    source = reasoning_gym.create_dataset("gsm_symbolic", size=300, seed=5)
    for i, row in enumerate(rows):
        assert row["answer"] == normalize_number(row["answer"])
        assert accuracy(f"#### {row['answer']}", row) == 1.0
        assert accuracy(source[i]["answer"], row) == 1.0
        # the worked solution reasoning-gym ships ends with "#### <answer>" as GSM8K does
        assert accuracy(source[i]["metadata"]["answer_cot"], row) == 1.0


# ------------------------------------------------------------------------------------------ build_task
def test_build_task_gsm_symbolic_defaults_and_total():
    task = build_task(OmegaConf.create({"dataset": "gsm_symbolic", "size": 50, "seed": 1}))
    assert isinstance(task, Task) and task.name == "gsm_symbolic" and len(task.rows) == 50
    assert task.reward_weights == {"accuracy": 1.0, "answer_format": 0.5}
    assert task.system_prompt == SYSTEM_PROMPT
    row = task.rows[0]
    msgs = task.messages(row)
    assert msgs == [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": row["question"]}]

    right = task.score(f"#### {row['answer']}", row)
    assert right == {"accuracy": 1.0, "answer_format": 1.0} and task.total(right) == 1.5
    bare = task.score(f"It is {row['answer']}.", row)
    assert bare == {"accuracy": 1.0, "answer_format": 0.0} and task.total(bare) == 1.0
    wrong = task.score("#### 123456789", row)
    assert wrong == {"accuracy": 0.0, "answer_format": 1.0} and task.total(wrong) == 0.5
    assert task.score("I don't know", row) == {"accuracy": 0.0, "answer_format": 0.0}


def test_build_task_reasoning_overrides_and_prompts():
    cfg = OmegaConf.create(
        {"dataset": "gsm_symbolic", "size": 10, "reasoning": True, "system_prompt": None,
         "reward_weights": {"accuracy": 2.0, "think_format": 0.25}}
    )
    OmegaConf.set_struct(cfg, True)  # hydra configs are struct: missing keys must still read as defaults
    task = build_task(cfg)
    assert task.reward_weights == {"accuracy": 2.0, "answer_format": 0.5, "think_format": 0.25}
    assert task.system_prompt == REASONING_SYSTEM_PROMPT
    row = task.rows[0]
    comps = task.score(f"<think>adding up</think>\n#### {row['answer']}", row)
    assert comps == {"accuracy": 1.0, "answer_format": 1.0, "think_format": 1.0}
    assert task.total(comps) == pytest.approx(2.75)

    custom = build_task({"dataset": "gsm_symbolic", "size": 5, "system_prompt": "Be brief."})
    assert custom.messages(custom.rows[0])[0] == {"role": "system", "content": "Be brief."}
    none = build_task({"dataset": "gsm_symbolic", "size": 5, "system_prompt": ""})
    assert none.system_prompt is None and [m["role"] for m in none.messages(none.rows[0])] == ["user"]


SHOT = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "```python\nprint(2 + 2)\n```"},
        {"role": "tool", "content": "4"}, {"role": "assistant", "content": "#### 4"}]


def test_worked_examples_come_between_the_system_prompt_and_the_question():
    task = build_task(OmegaConf.create({"dataset": "gsm_symbolic", "size": 5, "system_prompt": "Be brief.",
                                        "examples": SHOT}))
    row = task.rows[0]
    assert task.messages(row) == [{"role": "system", "content": "Be brief."}, *SHOT,
                                  {"role": "user", "content": row["question"]}]
    bare = build_task({"dataset": "gsm_symbolic", "size": 5, "system_prompt": "", "examples": SHOT})
    assert bare.messages(row) == [*SHOT, {"role": "user", "content": row["question"]}]
    assert build_task({"dataset": "gsm_symbolic", "size": 5, "examples": []}).examples == []


@pytest.mark.parametrize("examples, named", [
    ("2+2? 4", "env.examples='2+2? 4'"),
    ([{"role": "user", "content": "2+2?"}, {"role": "bot", "content": "4"}], "env.examples[1]="),
    ([{"role": "user", "content": 4}], "env.examples[0]="),
    ([{"role": "user", "content": "2+2?", "name": "x"}], "env.examples[0]="),
    ([{"role": "assistant", "content": "4"}], "begin with a user turn"),
    ([{"role": "user", "content": "2+2?"}], "end with the assistant's answer"),
])
def test_bad_worked_examples_are_one_line_naming_the_key(examples, named):
    with pytest.raises(ConfigError, match=re.escape(named)) as err:
        build_task({"dataset": "gsm_symbolic", "size": 5, "examples": examples})
    assert "\n" not in str(err.value)


@needs_data
def test_build_task_gsm8k_alias_with_data_path():
    task = build_task({"dataset": "gsm8k", "data_path": str(GSM8K), "split": "test"})
    assert task.name == "gsm8k" and len(task.rows) == 1319
    row = task.rows[0]
    assert task.score(f"#### {row['answer']}", row)["accuracy"] == 1.0


@pytest.mark.parametrize(
    "cfg, key",
    [
        ({"dataset": "nope"}, "env.dataset"),
        ({"dataset": "gsm_symbolic", "size": 5, "reward_weights": {"think_format": 1.0}},
         "env.reward_weights.think_format"),
        ({"dataset": "gsm_symbolic", "size": 5, "reward_weights": {"bogus": 1.0}}, "env.reward_weights.bogus"),
        ({"dataset": "gsm_symbolic", "size": 5, "reward_weights": {"accuracy": "high"}}, "env.reward_weights.accuracy"),
        ({"dataset": "gsm_symbolic", "size": 0}, "env.size"),
        ({"dataset": "gsm_symbolic", "size": 5, "reasoning": "yes"}, "env.reasoning"),
        ({"dataset": "gsm8k", "data_path": "/nonexistent/gsm8k"}, "env.data_path"),
    ],
)
def test_build_task_config_errors(cfg, key):
    with pytest.raises(ConfigError) as info:
        build_task(cfg)
    assert str(info.value).startswith(key) and "\n" not in str(info.value)


def test_custom_reward_and_task_plug_in():
    task = build_task({"dataset": "gsm_symbolic", "size": 5})
    task.add_reward("brevity", lambda completion, row: float(len(completion) < 20), weight=0.1)
    row = task.rows[0]
    comps = task.score(f"#### {row['answer']}", row)
    assert comps["brevity"] == 1.0 and task.total(comps) == pytest.approx(1.6)

    @dataclasses.dataclass(frozen=True)
    class ToySettings:
        question: str = "2+2?"

    @register_task("toy", settings=ToySettings)
    def build_toy(settings: ToySettings):
        import datasets

        rows = datasets.Dataset.from_dict({"question": [settings.question], "answer": ["4"]})
        return Task("toy", rows, None, []).add_reward("accuracy", accuracy)

    try:
        toy = build_task({"dataset": "toy", "question": "1+3?"})
        assert toy.messages(toy.rows[0]) == [{"role": "user", "content": "1+3?"}]
        assert toy.total(toy.score("4", toy.rows[0])) == 1.0
    finally:
        TASK_BUILDERS.pop("toy")
