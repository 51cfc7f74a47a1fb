"""A user's own prompts and rewards: env=prompts over their file, TRL-signature rewards beside ours (None, async,
batches), and the Python API that takes both as Python objects, run from a plain script as a user runs it."""
import asyncio
import json
import math
import os
import subprocess
import sys

import pandas as pd
import pytest

from helpers import SCRIPT_ENV, metric_rows, needs_vllm
from torchrl_grpo.core.errors import ConfigError, RunError
from torchrl_grpo.tasks import build_task, register_reward
from torchrl_grpo.tasks.prompts import _held_out

ROWS = [{"prompt": f"Summarize post {i}.", "topic": t, "target": n}
        for i, (t, n) in enumerate([("cats", 5), ("dogs", 9), ("cats", 3), ("fish", 12)])]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prompts_task(tmp_path, rows=ROWS, **env):
    return build_task({"dataset": "prompts", "data_path": str(write_jsonl(tmp_path / "p.jsonl", rows)), **env})


# ------------------------------------------------------------------------------------------- reward signatures
def trl_len(completions, **kwargs):  # TRL's quick-start reward
    return [-abs(20 - len(c)) for c in completions]


def per_topic(completions, prompts, completion_ids, topic, target, **kwargs):
    """TRL's signature with the dataset's columns as keyword lists; None where the reward does not apply."""
    return [None if t == "fish" else float(len(ids) == n) for ids, t, n in zip(completion_ids, topic, target)]


def ours(completion, row):
    return float(row["topic"] in completion)


def test_both_signatures_score_a_batch_with_none_left_out_of_the_total(tmp_path):
    task = prompts_task(tmp_path, rewards=[
        {"_target_": "test_own_prompts.trl_len", "weight": 0.5},
        {"_target_": "test_own_prompts.per_topic", "weight": 2.0},
        {"_target_": "test_own_prompts.ours"}])
    rows = list(task.rows)
    texts = ["cats " * 4, "no dogs here", "x", "fish" * 10]
    ids = [[1] * 5, [2] * 3, [3] * 3, [4] * 12]
    scores = task.score_batch(texts, rows, ids)
    assert [s["trl_len"] for s in scores] == [0.0, -8.0, -19.0, -20.0]
    assert [s["ours"] for s in scores] == [1.0, 1.0, 0.0, 1.0]
    assert scores[:3] == [dict(scores[0], per_topic=1.0), dict(scores[1], per_topic=0.0),
                          dict(scores[2], per_topic=1.0)]
    assert math.isnan(scores[3]["per_topic"])  # fish: not applicable
    expected = [0.5 * 0 + 2 * 1 + 1, 0.5 * -8 + 0 + 1, 0.5 * -19 + 2 + 0, 0.5 * -20 + 1]  # NaN left out, as nansum
    assert [task.total(s) for s in scores] == expected


def test_trl_rewards_get_chat_messages_for_conversational_prompts(tmp_path):
    seen = {}

    def spy(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return [1.0] * len(completions)

    rows = [{"messages": [{"role": "user", "content": "Hi"}]}, {"messages": [{"role": "user", "content": "Yo"}]}]
    task = prompts_task(tmp_path, rows, prompt_column="messages", system_prompt="Be brief.",
                        rewards=[register_reward(spy)])
    assert task.messages(task.rows[0]) == [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Hi"}]
    task.score_batch(["a", "b"], list(task.rows))
    assert seen["completions"] == [[{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": "b"}]]
    assert seen["prompts"][1][-1] == {"role": "user", "content": "Yo"}
    shot = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."}]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with_shot = prompts_task(tmp_path, [{"messages": chat}], prompt_column="messages", examples=shot,
                             rewards=[register_reward(spy)])
    assert with_shot.messages(with_shot.rows[0]) == [chat[0], *shot, chat[1]]  # after the row's own system turn


def test_async_rewards_run_concurrently_also_under_a_running_event_loop(tmp_path):
    """Every call of a batch is in flight at once (each waits until all have started): sequential calls would
    wait forever, so the barrier's timeout fails the test instead."""
    started = {"n": 0}

    def barrier(total):
        async def wait():
            started["n"] += 1
            for _ in range(500):
                if started["n"] >= total:
                    return
                await asyncio.sleep(0.01)
            raise TimeoutError(f"only {started['n']} of {total} calls were in flight together")
        return wait

    async def judge_one(completion, row):  # ours, async: 4 calls
        await barrier(5)()
        return 1.0

    async def judge_batch(completions, **kwargs):  # TRL's, async: 1 call
        await barrier(5)()
        return [0.5] * len(completions)

    task = prompts_task(tmp_path, rewards=[register_reward(judge_one), register_reward(judge_batch)])
    scores = task.score_batch(["a", "b", "c", "d"], list(task.rows))
    assert scores == [{"judge_one": 1.0, "judge_batch": 0.5}] * 4

    started["n"] = 0

    async def inside_a_loop():  # a notebook kernel's thread runs a loop already
        return task.score_batch(["a", "b", "c", "d"], list(task.rows))

    assert asyncio.run(inside_a_loop()) == scores


def test_a_batched_reward_of_the_wrong_length_or_raising_names_itself(tmp_path):
    def short(completions, **kwargs):
        return [1.0]

    task = prompts_task(tmp_path, rewards=[register_reward(short)])
    with pytest.raises(RunError, match=r"reward 'short' .* raised ValueError: returned 1 values for 2 completions"):
        task.score_batch(["a", "b"], list(task.rows)[:2])
    task.reward_errors = "zero"
    assert task.score_batch(["a", "b"], list(task.rows)[:2]) == [{"short": 0.0}] * 2
    assert task.reward_error_count == 2


# --------------------------------------------------------------------------------------------- env=prompts
@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_prompts_from_each_file_kind_keep_every_column(tmp_path, suffix):
    path = tmp_path / f"p{suffix}"
    frame = pd.DataFrame(ROWS)
    {".jsonl": lambda: write_jsonl(path, ROWS), ".csv": lambda: frame.to_csv(path, index=False),
     ".parquet": lambda: frame.to_parquet(path)}[suffix]()
    task = build_task({"dataset": "prompts", "data_path": str(path), "rewards": [register_reward(ours)]})
    assert list(task.rows) == ROWS
    assert task.messages(task.rows[1]) == [{"role": "user", "content": "Summarize post 1."}]


def test_holdout_splits_prompts_apart_the_same_way_every_time(tmp_path):
    rows = [{"prompt": f"Question number {i}?"} for i in range(200)]
    reward = [register_reward(ours)]
    train = prompts_task(tmp_path, rows, holdout=0.25, rewards=reward)
    held = prompts_task(tmp_path, rows, holdout=0.25, part="holdout", rewards=reward)
    train_p, held_p = {r["prompt"] for r in train.rows}, {r["prompt"] for r in held.rows}
    assert not train_p & held_p and len(train_p | held_p) == 200
    assert held_p == {r["prompt"] for r in rows if _held_out(r["prompt"], 0.25)}
    assert 30 <= len(held_p) <= 70  # about a quarter


@pytest.mark.parametrize("env, message", [
    ({"prompt_column": "question"}, r"^env.prompt_column=question: env.data_path=.*p.jsonl has no such column; its "
                                    r"columns are prompt, topic, target$"),
    ({"holdout": 0.0, "part": "holdout"}, r"^env.holdout=0.0: no prompt of .* is in the holdout part"),
    ({"holdout": 1.5}, r"^env.holdout=1.5: the share of prompts held out"),
    ({"rewards": []}, r"^env.rewards: env.dataset=prompts has no reward of its own"),
    ({"data_path": None}, r"^env.data_path: env=prompts needs your prompts"),
])
def test_bad_prompts_config_is_one_line_naming_the_key(tmp_path, env, message):
    env = {"rewards": [{"_target_": "test_own_prompts.ours"}], **env}
    with pytest.raises(ConfigError, match=message):
        prompts_task(tmp_path, **env)


def test_a_row_of_another_kind_is_named(tmp_path):
    rows = [{"prompt": "text"}, {"prompt": ""}]
    with pytest.raises(ConfigError, match=r"row 1 of .* is '', not non-empty text as the first row"):
        prompts_task(tmp_path, rows, rewards=[register_reward(ours)])


def test_a_notebook_function_in_another_process_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"_target_=__main__.nowhere: a function of the script or notebook"):
        build_task({"dataset": "gsm_symbolic", "size": 4, "rewards": [{"_target_": "__main__.nowhere"}]})


# -------------------------------------------------------------------------------------------- the Python API
SCRIPT = r'''
import json, random
import datasets
from torchrl_grpo import evaluate, train

random.seed(0)  # prompt-only rows shaped like trl-lib/tldr (prompt, completion), from a local file
words = ["I", "my", "friend", "money", "week", "said", "went", "home", "bought", "dinner"]
with open("tldr.jsonl", "w") as f:
    for i in range(48):
        post = " ".join(random.choice(words) for _ in range(30))
        f.write(json.dumps({"prompt": f"SUBREDDIT: r/AskReddit\n\nTITLE: post {i}\n\nPOST: {post}\n\nTL;DR:",
                            "completion": " a summary"}) + "\n")

def reward_len(completions, **kwargs):  # TRL's quick start, unchanged
    return [-abs(20 - len(completion)) for completion in completions]

dataset = datasets.load_dataset("json", data_files="tldr.jsonl", split="train")
small = ["model=tiny", "inference_model.max_tokens=8", "logging.progress_bar=false"]
run_dir = train(small, env={"num_envs": 4, "repeats": 8}, optimizer={"lr": 3e-3}, loss={"aggregation": "token_mean"},
                train={"optim_batch_size": 16, "gradient_accumulation_steps": 1, "total_dialog_turns": 640},
                logging={"checkpoint_frequency": 0}, dataset=dataset, reward_funcs=[reward_len])
print("RUN", len(run_dir.metrics), run_dir.checkpoint.name, repr(run_dir.generate("TL;DR: hello", max_new_tokens=4)))
eval_dir = evaluate([*small, "eval.num_prompts=8"], dataset=dataset.to_list()[:8], reward_funcs=[reward_len])
for bad in (lambda: train(["model=tiny", "optimizer.lr=fast"]), lambda: train(model="tiny", optimizer={"lrr": 1e-3})):
    try:
        bad()
    except Exception as err:
        print("BAD", type(err).__name__, err)
print("DIRS", json.dumps([str(run_dir), str(eval_dir)]))
'''


@needs_vllm
def test_trl_quick_start_trains_from_a_plain_script_and_its_reward_rises(tmp_path):
    """TRL's first GRPO example (reward_len on a prompt-only dataset shaped like trl-lib/tldr), through
    ``from torchrl_grpo import train, evaluate`` with Python objects: a Dataset, the function itself, settings as
    keyword arguments beside override strings; the returned run's metrics, checkpoint and trained policy."""
    (tmp_path / "quick_start.py").write_text(SCRIPT)
    out = subprocess.run([sys.executable, "quick_start.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env={**os.environ, **SCRIPT_ENV})
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir, eval_dir = map(type(tmp_path), json.loads(out.stdout.split("DIRS ", 1)[1]))
    assert run_dir.parent.parent == tmp_path / "outputs"  # outputs/<date>/<time>, as the command
    rows = metric_rows(run_dir)
    assert len(rows) == 20
    first, last = (sum(float(r["reward/reward_len"]) for r in part) / 5 for part in (rows[:5], rows[-5:]))
    assert last > first + 0.5, (first, last)
    assert (run_dir / "grpo.log").exists() and (run_dir / "prompts.jsonl").exists()
    assert "_target_: __main__.reward_len" in (run_dir / ".hydra" / "config.yaml").read_text()
    # the samples file: each completion with its prompt, reward (TRL's formula, recomputed here), its component
    # and the advantage (zero-mean over each prompt's 8 completions)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    prompts = {json.loads(line)["prompt"] for line in (tmp_path / "tldr.jsonl").read_text().splitlines()}
    assert samples and {s["prompt"] for s in samples} <= prompts
    assert all(s["reward"] == s["reward/reward_len"] == -abs(20 - len(s["completion"])) for s in samples)
    for group in (samples[i:i + 8] for i in range(0, len(samples), 8)):
        assert len({s["prompt"] for s in group}) == 1 and abs(sum(s["advantage"] for s in group)) < 1e-4
    metrics = json.loads((eval_dir / "eval_metrics.json").read_text())
    assert metrics["prompts"] == 8.0 and -20 <= metrics["reward/reward_len"] <= 0
    assert "BAD ConfigError optimizer.lr=" in out.stdout  # raised, not exit(2), with the command's one line
    assert "BAD ConfigError optimizer.lrr: no such key in the config" in out.stdout  # a keyword setting's key
    assert "RUN 20 step_000020 '" in out.stdout  # the returned run: its 20 steps' metrics, its checkpoint, a reply
