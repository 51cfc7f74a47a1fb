"""IFEval task: loading (local JSONL, hub schema), the four rewards, the golden GPT-4 scores, NLTK offline
data, build_task, the Hydra config and one real grpo.py run."""
import json
import os
import random
import subprocess
import sys
import textwrap

import datasets
import pytest

from helpers import IFEVAL, ROOT, cfg_with, metric_rows, needs_files, needs_vllm, run
from torchrl_grpo.config.validate import validate
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.tasks import TASK_BUILDERS, build_task
from torchrl_grpo.tasks.ifeval import (
    REWARD_NAMES,
    _evaluate,
    _prepare,
    clean_kwargs,
    ensure_punkt_tab,
    evaluate,
    instruction_ids,
    load_ifeval,
)

INPUT = IFEVAL / "input_data.jsonl"
GPT4 = IFEVAL / "gpt4_responses.jsonl"
needs_data = needs_files(INPUT, GPT4)


def _row(ids, kwargs, question="Write something."):
    return {"question": question, "key": 0, "instruction_id_list": ids, "kwargs": json.dumps(kwargs)}


# ---------------------------------------------------------------------------------------------- loading
@needs_data
def test_local_jsonl_rows():
    rows = load_ifeval(data_path=str(INPUT))
    assert len(rows) == 541
    assert set(rows.column_names) == {"question", "key", "instruction_id_list", "kwargs"}
    first = rows[0]
    assert first["key"] == 1000 and first["question"].startswith("Write a 300+ word summary")
    assert first["instruction_id_list"] == ["punctuation:no_comma", "detectable_format:number_highlighted_sections",
                                            "length_constraints:number_words"]
    assert json.loads(first["kwargs"]) == [{}, {"num_highlights": 3}, {"relation": "at least", "num_words": 300}]
    all_kwargs = [json.loads(k) for k in rows["kwargs"]]
    assert sum(len(k) for k in all_kwargs) == 834
    assert all(v is not None for ks in all_kwargs for one in ks for v in one.values())
    assert len({i for ids in rows["instruction_id_list"] for i in ids}) == 25
    assert set(instruction_ids()) >= {i for ids in rows["instruction_id_list"] for i in ids}


def test_clean_kwargs_drops_none():
    assert clean_kwargs([{"a": 1, "b": None}, None, {}]) == [{"a": 1}, {}, {}]
    assert clean_kwargs('[{"num_words": 5, "relation": null}]') == [{"num_words": 5}]
    assert clean_kwargs(None) == []
    with pytest.raises(TypeError):
        clean_kwargs({"a": 1})


HUB_ROWS = [  # the hub's google/IFEval schema: every kwargs key of every instruction, unused ones null
    {"key": 7, "prompt": "Describe a cat in lowercase, no commas.",
     "instruction_id_list": ["punctuation:no_comma", "change_case:english_lowercase"],
     "kwargs": [{"num_words": None, "relation": None, "letter": None},
                {"num_words": None, "relation": None, "letter": None}]},
    {"key": 8, "prompt": "Answer in fewer than 5 words.",
     "instruction_id_list": ["length_constraints:number_words"],
     "kwargs": [{"num_words": 5, "relation": "less than", "letter": None}]},
]


def test_hub_schema_adapter(tmp_path):
    raw = datasets.Dataset.from_list(HUB_ROWS)  # datasets merges the dicts into one struct, like the hub
    assert raw[0]["kwargs"][0] == {"num_words": None, "relation": None, "letter": None}
    rows = _prepare(raw, "test")
    assert json.loads(rows[0]["kwargs"]) == [{}, {}]
    assert json.loads(rows[1]["kwargs"]) == [{"num_words": 5, "relation": "less than"}]
    assert evaluate("a small furry cat", rows[0])["prompt_strict"] == 1.0
    assert evaluate("cats are small", rows[1])["prompt_strict"] == 1.0
    assert evaluate("cats are small furry and quite lovely", rows[1])["prompt_strict"] == 0.0
    # the hub's parquet layout (data/train-*.parquet) in a folder, through env.data_path
    (tmp_path / "data").mkdir()
    raw.to_parquet(str(tmp_path / "data" / "train-00000-of-00001.parquet"))
    again = load_ifeval(data_path=str(tmp_path))
    assert again["kwargs"] == rows["kwargs"] and again["key"] == [7, 8]


def test_bad_rows_and_paths_name_the_key(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"key": 1, "prompt": "p", "instruction_id_list": ["no:such_check"],
                               "kwargs": [{}]}) + "\n")
    with pytest.raises(ConfigError, match=r"^env.data_path=.*unknown instruction id"):
        load_ifeval(data_path=str(bad))
    bad.write_text(json.dumps({"key": 1, "prompt": "p", "instruction_id_list": ["punctuation:no_comma"],
                               "kwargs": [{}, {}]}) + "\n")
    with pytest.raises(ConfigError, match=r"^env.data_path=.*1 instruction ids but 2 kwargs"):
        load_ifeval(data_path=str(bad))
    with pytest.raises(ConfigError, match=r"^env.data_path=.*no such file"):
        load_ifeval(data_path=str(tmp_path / "missing.jsonl"))


def test_offline_hub_is_one_line_naming_the_fix():
    with pytest.raises(ConfigError) as err:
        build_task({"dataset": "google/IFEval"})
    msg = str(err.value)
    assert msg.startswith("env.dataset=google/IFEval") and "env.data_path=" in msg and "\n" not in msg


# ---------------------------------------------------------------------------------------------- rewards
def test_rewards_on_hand_cases():
    row = _row(["punctuation:no_comma", "change_case:english_lowercase"], [{}, {}])
    assert evaluate("hello world", row) == dict.fromkeys(REWARD_NAMES, 1.0)
    assert evaluate("hello, world", row) == {"instruction_strict": 0.5, "instruction_loose": 0.5,
                                             "prompt_strict": 0.0, "prompt_loose": 0.0}
    assert evaluate("Hello, World", row) == dict.fromkeys(REWARD_NAMES, 0.0)
    assert evaluate("", row) == dict.fromkeys(REWARD_NAMES, 0.0)
    # loose: dropping the last line (a sign-off) makes the end phrase the last words
    end = "Is there anything else I can help with?"
    row = _row(["startend:end_checker", "punctuation:no_comma"], [{"end_phrase": end}, {}])
    assert evaluate(f"sure thing. {end}\nbye", row) == {"instruction_strict": 0.5, "instruction_loose": 1.0,
                                                        "prompt_strict": 0.0, "prompt_loose": 1.0}
    # kwargs as a list (not JSON) work too, with None dropped
    row = {"question": "q", "instruction_id_list": ["length_constraints:number_words"],
           "kwargs": [{"num_words": 3, "relation": "less than", "letter": None}]}
    assert evaluate("two words", row)["prompt_strict"] == 1.0


@needs_data
def test_golden_gpt4_scores():
    rows = load_ifeval(data_path=str(INPUT))
    with open(GPT4) as f:
        responses = [json.loads(line)["response"] for line in f if line.strip()]
    assert len(responses) == len(rows) == 541
    state = random.getstate()
    prompt = {"strict": 0, "loose": 0}
    inst = {"strict": 0, "loose": 0}
    for row, response in zip(rows, responses):
        s = evaluate(response, row)
        n = len(row["instruction_id_list"])
        prompt["strict"] += s["prompt_strict"]
        prompt["loose"] += s["prompt_loose"]
        inst["strict"] += round(s["instruction_strict"] * n)
        inst["loose"] += round(s["instruction_loose"] * n)
    assert random.getstate() == state  # the checkers' random draws leave the caller's stream alone
    # IFEval's reference checkers (and the paper's GPT-4 row): strict 416/541 prompts, 697/834 instructions
    assert (prompt["strict"], inst["strict"]) == (416, 697)
    assert (prompt["loose"], inst["loose"]) == (430, 713)


@needs_data
def test_evaluate_py_scores_the_published_gpt4_file(tmp_path):
    # {prompt, response} only: rows found by prompt; line 340's prompt differs from the input data's, and the
    # file lines up with it row by row, so that one takes row 340
    out = run(["--config-name", "grpo_ifeval", f"env.data_path={INPUT}", f"eval.responses={GPT4}",
               f"hydra.run.dir={tmp_path}/run"], tmp_path, script="evaluate.py")
    assert out.returncode == 0, out.stderr[-2000:]
    metrics = json.loads(out.stdout.strip().splitlines()[-1])
    assert metrics["prompts"] == metrics["responses"] == 541
    assert metrics["accuracy"] == metrics["reward/prompt_strict"] == pytest.approx(416 / 541)
    records = [json.loads(line) for line in open(tmp_path / "run" / "eval_responses.jsonl")]
    inputs = [json.loads(line) for line in open(INPUT)]
    assert [r["question"] for r in records] == [row["prompt"] for row in inputs]
    # reward/instruction_strict is the mean over prompts of the share followed; instruction-level (IFEval's
    # paper): 697 of all 834 instructions followed, printed as such
    mean = sum(r["scores"]["instruction_strict"] for r in records) / 541
    assert metrics["reward/instruction_strict"] == pytest.approx(mean)
    assert (metrics["instruction_strict/passed"], metrics["instruction_strict/checks"]) == (697, 834)
    assert metrics["instruction_strict/pooled"] == pytest.approx(697 / 834)
    assert (metrics["instruction_loose/passed"], metrics["solved"]) == (713, 416)
    assert "solved: 416/541 responses" in out.stdout
    assert "instruction_strict pooled over all checks: 697/834 = 0.8357" in out.stdout


@needs_data
def test_random_letter_rows_score_the_same_every_time():
    rows = load_ifeval(data_path=str(INPUT))
    with open(GPT4) as f:
        responses = [json.loads(line)["response"] for line in f if line.strip()]
    state = random.getstate()
    try:
        for i, letter in ((19, "#"), (22, "!")):  # keywords:letter_frequency with a letter the checker refuses
            assert {"letter": letter}.items() <= next(k for k in json.loads(rows[i]["kwargs"]) if "letter" in k).items()
            first = evaluate(responses[i], rows[i])
            for seed in range(5):  # the checker draws a random letter instead: seeded per prompt, not globally
                random.seed(seed)
                _evaluate.cache_clear()
                assert evaluate(responses[i], rows[i]) == first
    finally:
        random.setstate(state)


# ----------------------------------------------------------------------------------------- NLTK offline
def test_ensure_punkt_tab_is_idempotent(tmp_path, monkeypatch):
    import nltk.data

    monkeypatch.setenv("TORCHRL_GRPO_CACHE", str(tmp_path))
    monkeypatch.setenv("NLTK_DATA", "")
    monkeypatch.setattr(nltk.data, "path", list(nltk.data.path))
    root = ensure_punkt_tab()
    model = root / "tokenizers" / "punkt_tab" / "english"
    assert root == tmp_path / "nltk_data"
    names = {"collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab", "README"}
    assert {p.name for p in model.iterdir()} == names
    assert [p.name for p in model.parent.iterdir()] == ["english"]  # no temporary leftovers
    stamps = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in model.iterdir()}
    assert "mr" in (model / "abbrev_types.txt").read_text().split("\n")
    assert ensure_punkt_tab() == root
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in model.iterdir()} == stamps
    assert nltk.data.path.count(str(root)) == 1 and os.environ["NLTK_DATA"] == str(root)
    # a damaged model is rebuilt
    (model / "ortho_context.tab").unlink()
    ensure_punkt_tab()
    assert (model / "ortho_context.tab").stat().st_size > 100_000


NLTK_CHECK = textwrap.dedent("""
    import nltk

    def no_download(*args, **kwargs):
        raise AssertionError("nltk.download was called")

    nltk.download = no_download
    from torchrl_grpo.tasks.ifeval import ensure_punkt_tab, evaluate

    root = ensure_punkt_tab()
    print(nltk.sent_tokenize("Mr. Smith went to Washington. He arrived on Monday."))
    row = {"question": "q", "instruction_id_list": ["length_constraints:number_sentences"],
           "kwargs": [{"num_sentences": 3, "relation": "less than"}]}
    print(evaluate("Dr. Who came at 5 p.m. today. He left.", row)["prompt_strict"],
          evaluate("One. Two. Three. Four.", row)["prompt_strict"])
    row = {"question": "q", "instruction_id_list": ["change_case:capital_word_frequency"],
           "kwargs": [{"capital_frequency": 2, "capital_relation": "at least"}]}
    print(evaluate("The NASA and ESA teams met.", row)["prompt_strict"],
          evaluate("The NASA team met.", row)["prompt_strict"])
""")


def test_nltk_checkers_work_offline_without_download(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NLTK_DATA"}
    env.update(HF_HUB_OFFLINE="1", TORCHRL_GRPO_CACHE=str(tmp_path / "cache"), HOME=str(tmp_path),
               PYTHONPATH=str(ROOT))
    for _ in range(2):  # a fresh cache, then the cached model
        out = subprocess.run([sys.executable, "-c", NLTK_CHECK], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.split("\n")[:3] == [
            "['Mr. Smith went to Washington.', 'He arrived on Monday.']", "1.0 0.0", "1.0 0.0"], out.stdout


# ------------------------------------------------------------------------------------- task and config
@needs_data
def test_build_task_from_env_config():
    assert TASK_BUILDERS["google/IFEval"] is TASK_BUILDERS["ifeval"]
    task = build_task({"dataset": "google/IFEval", "data_path": str(INPUT)})
    assert task.name == "ifeval" and len(task) == 541 and task.system_prompt is None
    assert task.reward_names == list(REWARD_NAMES)
    assert task.reward_weights == {"instruction_strict": 1.0, "instruction_loose": 0.0,
                                   "prompt_strict": 0.0, "prompt_loose": 0.0}
    row = task.rows[1]
    assert task.messages(row) == [{"role": "user", "content": row["question"]}]
    components = task.score("no commas here", row)  # key 1001: punctuation:no_comma only
    assert components == dict.fromkeys(REWARD_NAMES, 1.0) and task.total(components) == 1.0

    task = build_task({"dataset": "ifeval", "data_path": str(INPUT), "reward": "prompt_loose",
                       "system_prompt": "Follow every instruction.", "reward_weights": {"instruction_strict": 0.5}})
    assert task.reward_weights == {"instruction_strict": 0.5, "instruction_loose": 0.0,
                                   "prompt_strict": 0.0, "prompt_loose": 1.0}
    assert task.messages(row)[0] == {"role": "system", "content": "Follow every instruction."}
    with pytest.raises(ConfigError, match=r"^env.reward='accuracy': choose one of instruction_strict"):
        build_task({"dataset": "google/IFEval", "data_path": str(INPUT), "reward": "accuracy"})
    with pytest.raises(ConfigError, match=r"^env.reward_weights.accuracy: unknown reward component"):
        build_task({"dataset": "google/IFEval", "data_path": str(INPUT), "reward_weights": {"accuracy": 1}})
    # the recipe's env group, pointed at the local file
    assert build_task(cfg_with(f"env.data_path={INPUT}", name="grpo_ifeval").env).name == "ifeval"


def test_grpo_ifeval_config_composes():
    cfg = cfg_with(name="grpo_ifeval")
    small = cfg_with("model=qwen2.5-1.5b-instruct", "env.reward=prompt_strict", name="grpo_ifeval")
    assert cfg.env.dataset == "google/IFEval" and cfg.env.data_path is None and cfg.env.split == "train"
    assert cfg.env.reward == "instruction_strict" and cfg.env.reward_weights is None
    assert cfg.env.num_envs == 2 and cfg.env.repeats == 8 and "reasoning" not in cfg.env
    assert cfg.train.exp_name == "grpo-ifeval" and cfg.inference_model.max_tokens == 256
    assert cfg.model.name == "smollm2-135m-instruct" and cfg.loss.aggregation == "sequence_mean"
    validate(cfg)
    assert small.model.name == "Qwen/Qwen2.5-1.5B-Instruct" and small.env.reward == "prompt_strict"


# ------------------------------------------------------------------------------------------ end to end
@needs_data
@needs_vllm
def test_grpo_py_trains_on_ifeval(tmp_path):
    run_dir = tmp_path / "run"
    # IFEval's rows that forbid commas: a comma-free completion of the tiny random model follows at least that
    # instruction, so that the rewards checked below are not all zero
    no_comma = tmp_path / "no_comma.jsonl"
    with open(INPUT) as f, open(no_comma, "w") as kept:
        kept.writelines(line for line in f if line.strip()
                        and "punctuation:no_comma" in json.loads(line)["instruction_id_list"])
    # env.reward (instruction_strict) weighs 1 and prompt_loose 0.5 on top: the total is a true weighted sum
    out = run(["--config-name", "grpo_ifeval", "model=tiny", f"env.data_path={no_comma}", "env.num_envs=2",
               "env.repeats=4", "env.reward_weights={prompt_loose:0.5}", "train.optim_batch_size=4",
               "inference_model.max_tokens=16", "train.total_dialog_turns=16", "logging.progress_bar=false",
               f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = out.stdout[out.stdout.index("summary:"):]
    for name in REWARD_NAMES:
        assert f"reward/{name}" in summary
    logged = metric_rows(run_dir)
    assert [int(float(r["step"])) for r in logged] == [1, 2]
    assert max(float(r["reward/instruction_strict"]) for r in logged) > 0
    for r in logged:  # each value a mean over the step's 8 completions
        means = {name: float(r[f"reward/{name}"]) for name in REWARD_NAMES}
        assert all(0 <= v <= 1 for v in means.values()), means  # NaN fails too
        for level in ("strict", "loose"):
            prompt, instruction = means[f"prompt_{level}"], means[f"instruction_{level}"]
            assert prompt * 8 == round(prompt * 8), means  # 0 or 1 per completion
            assert prompt <= instruction, means  # a prompt passes only where all its instructions do
        # the loose rules retry variants of the response after the response itself
        assert means["instruction_strict"] <= means["instruction_loose"], means
        assert means["prompt_strict"] <= means["prompt_loose"], means
        total = means["instruction_strict"] + 0.5 * means["prompt_loose"]
        assert float(r["reward"]) == pytest.approx(total, abs=1e-6), (r["reward"], means)
