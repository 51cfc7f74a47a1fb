"""Evaluation: pass@k against brute force, scoring hand-made responses, reading response files, and
evaluate.py as users run it (a real subprocess: responses mode on GSM8K's test rows, generation mode with
the tiny model on the vLLM CPU engine)."""
import itertools
import json

import pytest
from omegaconf import OmegaConf

from helpers import GSM8K, needs_files, needs_vllm, run
from torchrl_grpo.config.spec import eval_env
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.run.evaluation import ks_for, match_rows, pass_at_k, read_responses, score_responses
from torchrl_grpo.tasks import build_task


def brute_pass_at_k(outcomes: list[bool], k: int) -> float:
    """The share of all k-subsets of the responses that hold at least one correct one."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n, c", [(1, 0), (1, 1), (4, 0), (4, 1), (4, 3), (5, 2), (8, 8)])
def test_pass_at_k_equals_brute_force_over_subsets(n, c):
    outcomes = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(outcomes, k), abs=1e-12)


def test_pass_at_k_bad_arguments_and_ks():
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)
    assert ks_for(1) == [1] and ks_for(4) == [1, 2, 4] and ks_for(6) == [1, 2, 4, 6]


def gsm_task():
    return build_task(OmegaConf.create({"dataset": "gsm_symbolic", "size": 4, "seed": 0}))


def test_score_responses_by_hand():
    task = gsm_task()
    rows = [dict(task.rows[i]) for i in range(2)]
    right = [f"#### {r['answer']}" for r in rows]
    # row 0: 1 of 3 right (format on all 3: the wrong one still has "#### 999999"); row 1: 2 of 3 right,
    # the unformatted one holds the right number last (accuracy counts it, the format does not)
    responses = [[right[0], "#### 999999", "no idea"], [right[1], f"it is {rows[1]['answer']}", "#### 999999"]]
    metrics, records = score_responses(task, rows, responses)
    accuracy = [[1, 0, 0], [1, 1, 0]]
    fmt = [[1, 1, 0], [1, 0, 1]]
    assert metrics["accuracy"] == pytest.approx(3 / 6)
    assert metrics["pass@1"] == pytest.approx((1 / 3 + 2 / 3) / 2)
    assert metrics["pass@2"] == pytest.approx(((1 - 1 / 3) + 1.0) / 2)  # C(2,2)/C(3,2) = 1/3 miss for row 0
    assert "pass@3" in metrics and metrics["pass@3"] == pytest.approx(1.0)
    assert metrics["reward/answer_format"] == pytest.approx(4 / 6)
    totals = [a + 0.5 * f for ra, rf in zip(accuracy, fmt) for a, f in zip(ra, rf)]
    assert metrics["reward"] == pytest.approx(sum(totals) / 6)
    assert [r["scores"]["reward"] for r in records] == totals
    assert records[4]["response"] == responses[1][1] and records[4]["question"] == rows[1]["question"]


def test_read_responses_groups_by_row_and_ignores_scores(tmp_path):
    path = tmp_path / "r.jsonl"
    lines = [{"question": "a", "answer": "1", "response": "x"}, {"question": "b", "answer": "2", "response": "y"},
             {"question": "a", "answer": "1", "response": "z", "scores": {"reward": 1.0}}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    rows, responses = read_responses(path, gsm_task())  # records with the task's row fields: taken as they are
    assert rows == [{"question": "a", "answer": "1"}, {"question": "b", "answer": "2"}]
    assert responses == [["x", "z"], ["y"]]
    path.write_text('{"question": "a"}\n')
    with pytest.raises(ConfigError, match='line 1 has no string field "response"'):
        read_responses(path, gsm_task())
    path.write_text("not json\n")
    with pytest.raises(ConfigError, match="line 1 is not JSON"):
        read_responses(path, gsm_task())


def test_match_rows_by_text_or_row_by_row():
    assert match_rows(["b", "a", "b"], ["a", "b", "c"]) == [1, 0, 1]  # by text, in any order
    assert match_rows(["a", "B", "c"], ["a", "b", "c"]) == [0, 1, 2]  # lined up: "B" takes its own row
    assert match_rows(["c", "B", "a"], ["a", "b", "c"]) == [2, None, 0]  # same count, not lined up
    assert match_rows(["x", "y", "c"], ["a", "b", "c"]) == [None, None, 2]  # too few found to call it lined up
    assert match_rows(["a", "a"], ["a", "a"]) == [0, 1]  # a repeated prompt, lined up: each its own row


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_read_responses_finds_rows_by_prompt(tmp_path):
    task = gsm_task()
    q = task.rows["question"]
    path = write_jsonl(tmp_path / "r.jsonl", [{"prompt": q[2], "response": "x"}, {"question": q[0], "response": "y"},
                                              {"prompt": q[2], "response": "z"}])
    rows, responses = read_responses(path, task)
    assert rows == [task.rows[2], task.rows[0]] and responses == [["x", "z"], ["y"]]


def test_read_responses_lined_up_file_with_one_differing_prompt(tmp_path):
    task = gsm_task()
    prompts = list(task.rows["question"])
    prompts[1] = prompts[1].replace("pebbles", "stones")  # an edited copy: no row has this text
    path = write_jsonl(tmp_path / "r.jsonl", [{"prompt": p, "response": str(i)} for i, p in enumerate(prompts)])
    rows, responses = read_responses(path, task)
    assert rows == [task.rows[i] for i in range(4)] and responses == [["0"], ["1"], ["2"], ["3"]]
    path = write_jsonl(path, [{"prompt": p, "response": "r"} for p in reversed(prompts)])  # not lined up
    with pytest.raises(ConfigError, match="line 3's prompt 'Robert has a bag of stones"):
        read_responses(path, task)


def test_read_responses_prompt_matching_nothing_is_one_line(tmp_path):
    task = gsm_task()
    path = write_jsonl(tmp_path / "r.jsonl", [{"prompt": task.rows[0]["question"], "response": "x"},
                                              {"prompt": "Nothing like\nthis prompt", "response": "y"}])
    with pytest.raises(ConfigError) as err:
        read_responses(path, task)
    assert str(err.value) == (
        f"eval.responses={path}: line 2's prompt 'Nothing like\\nthis prompt'... is none of the 4 prompts of "
        f"gsm_symbolic's evaluation split; give responses to that split (env.data_path, env.eval), or records "
        f"with its rows' fields (question, answer)")
    write_jsonl(path, [{"text": "q", "response": "x"}])
    with pytest.raises(ConfigError, match="line 1 has neither the fields of gsm_symbolic's rows \\(question, answer\\) "
                                          'nor a "question", "prompt" or "problem" to find its row by'):
        read_responses(path, task)


def test_eval_env_merges_the_eval_block_over_env():
    env = OmegaConf.create({"dataset": "openai/gsm8k", "split": "train", "data_path": "/d", "eval": {"split": "test"}})
    merged = eval_env(env)
    assert merged == {"dataset": "openai/gsm8k", "split": "test", "data_path": "/d"}
    assert eval_env({**env, "eval": None}) == {"dataset": "openai/gsm8k", "split": "train", "data_path": "/d"}


def evaluate(args, cwd, env_extra=None):
    """evaluate.py run to its end, its outputs in ``cwd/run``."""
    return run([*args, f"hydra.run.dir={cwd}/run"], cwd, script="evaluate.py", env_extra=env_extra)


@needs_files(GSM8K / "test.jsonl")
def test_evaluate_py_scores_a_responses_file_of_gsm8k_test_rows(tmp_path):
    rows = [json.loads(line) for line in open(GSM8K / "test.jsonl")][:4]
    with open(tmp_path / "responses.jsonl", "w") as f:
        for i, row in enumerate(rows):
            gold = row["answer"].rsplit("####", 1)[1].strip()
            for response in ([f"So #### {gold}", "#### 0.123"] if i % 2 == 0 else ["#### 0.123", "#### 0.456"]):
                f.write(json.dumps({**row, "response": response}) + "\n")
    out = evaluate(["env=gsm8k", f"env.data_path={GSM8K}", f"eval.responses={tmp_path / 'responses.jsonl'}"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    metrics = json.loads(out.stdout.strip().splitlines()[-1])
    assert metrics["prompts"] == 4 and metrics["responses"] == 8
    assert metrics["accuracy"] == pytest.approx(2 / 8) and metrics["pass@2"] == pytest.approx(2 / 4)
    assert metrics["reward/answer_format"] == 1.0
    assert json.loads((tmp_path / "run" / "eval_metrics.json").read_text()) == metrics
    assert len((tmp_path / "run" / "eval_responses.jsonl").read_text().splitlines()) == 8


def test_evaluate_py_responses_matching_no_prompt_is_one_line(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", [{"prompt": "What is 2 + 2?", "response": "#### 4"}])
    out = evaluate(["env=gsm_symbolic", f"eval.responses={path}"], tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    [line] = out.stderr.strip().splitlines()
    assert line.startswith(f"error: eval.responses={path}: line 1's prompt 'What is 2 + 2?'... is none of the ")


def test_evaluate_py_bad_key_is_one_line(tmp_path):
    out = evaluate(["env=gsm_symbolic", "eval.samples=4"], tmp_path)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: eval.samples=4 with eval.temperature=0: greedy decoding gives 4 identical responses; "
        "set eval.temperature>0 (e.g. 1.0) for pass@k, or eval.samples=1"]


@needs_vllm
def test_evaluate_py_generates_with_vllm_then_rescores_its_own_file(tmp_path):
    """A first run on an empty model cache: the model is built once, then evaluated."""
    args = ["model=tiny", "env=reasoning_gym", "env.eval.size=2", "eval.num_prompts=6", "eval.samples=2",
            "eval.temperature=1.0", "inference_model.max_tokens=8"]
    out = evaluate(args, tmp_path, env_extra={"TORCHRL_GRPO_CACHE": str(tmp_path / "cache")})
    assert out.returncode == 0, out.stderr[-3000:]
    assert (out.stdout + out.stderr).count("(once; cached afterwards)") == 1
    metrics = json.loads(out.stdout.strip().splitlines()[-1])
    assert metrics["prompts"] == 6 and metrics["responses"] == 12
    # 2 responses to every prompt: pass@1 is the accuracy, and a second try can only help
    assert 0 <= metrics["pass@1"] <= metrics["pass@2"] <= 1 and metrics["pass@1"] == pytest.approx(metrics["accuracy"])
    # interleaved rows: the first 6 prompts hold the 5 evaluation tasks, the held-out one included
    assert "base_conversion/accuracy" in metrics and "maze/reward" in metrics
    written = tmp_path / "run" / "eval_responses.jsonl"
    (tmp_path / "again").mkdir()
    again = evaluate(["env=reasoning_gym", "env.eval.size=2", f"eval.responses={written}"], tmp_path / "again")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.strip().splitlines()[-1]) == metrics
