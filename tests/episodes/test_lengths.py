"""Prompts against the engine's context (torchrl_grpo/episodes/lengths.py): a row fits when its templated prompt plus
``max_tokens`` x turns is at most ``max_model_len``; the others are left out with one warning, or refused; no row
fitting is one line naming the keys. The expected lengths are the tokenizer's own count of each templated prompt."""
import json

import datasets
import pytest

from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.episodes.lengths import fit_prompts
from torchrl_grpo.models.loading import load_tokenizer
from torchrl_grpo.models.sources import context_limit
from torchrl_grpo.tasks import Task

QUESTIONS = ["one", "two words", " ".join(["many"] * 60), "three small words", " ".join(["more"] * 120)]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return load_tokenizer(tiny_model_path)


def make_task() -> Task:
    return Task("lengths", datasets.Dataset.from_dict({"question": QUESTIONS, "answer": ["1"] * len(QUESTIONS)}),
                "Answer briefly.")


def templated_lengths(tokenizer) -> list[int]:
    """Each row's prompt length, counted by the tokenizer's own chat template (tokenize=True)."""
    return [len(tokenizer.apply_chat_template([{"role": "system", "content": "Answer briefly."},
                                               {"role": "user", "content": q}], tokenize=True,
                                              add_generation_prompt=True, return_dict=True)["input_ids"])
            for q in QUESTIONS]


def test_rows_that_do_not_fit_are_left_out_with_one_warning(tokenizer):
    lengths = templated_lengths(tokenizer)
    short = sorted(lengths)[2]  # the three shortest fit with 10 completion tokens, the two long ones do not
    task = make_task()
    dropped = fit_prompts(task, tokenizer, max_tokens=10, max_model_len=short + 10)
    kept = [q for q, n in zip(QUESTIONS, lengths) if n + 10 <= short + 10]
    assert list(task.rows["question"]) == kept and len(kept) == 3
    assert (dropped.count, dropped.total, dropped.longest) == (2, 5, max(lengths))
    assert dropped.message == (f"warning: 2 of 5 env rows do not fit inference_model.max_model_len={short + 10} "
                               f"(prompt + inference_model.max_tokens=10; the longest prompt has {max(lengths)} "
                               "tokens): left out (env.overlong_prompts=error refuses them instead)")


def test_every_row_fitting_leaves_the_task_as_it_was(tokenizer):
    task = make_task()
    rows = task.rows
    assert fit_prompts(task, tokenizer, max_tokens=10, max_model_len=max(templated_lengths(tokenizer)) + 10) is None
    assert task.rows is rows


def test_multi_turn_rows_need_room_for_every_turn(tokenizer):
    lengths = templated_lengths(tokenizer)
    task = make_task()
    fit_prompts(task, tokenizer, max_tokens=10, max_model_len=max(lengths) + 29, max_turns=3)  # 3 x 10 do not fit
    assert len(task.rows) == 4 and QUESTIONS[4] not in task.rows["question"]


def test_refused_when_asked_or_when_no_row_fits(tokenizer):
    lengths = templated_lengths(tokenizer)
    with pytest.raises(ConfigError) as err:
        fit_prompts(make_task(), tokenizer, max_tokens=10, max_model_len=min(lengths) + 10, overlong="error")
    assert str(err.value) == (f"4 of 5 env rows do not fit inference_model.max_model_len={min(lengths) + 10} (prompt + "
                              f"inference_model.max_tokens=10; the longest prompt has {max(lengths)} tokens): set "
                              f"inference_model.max_model_len to at least {max(lengths) + 10}, or "
                              "env.overlong_prompts=drop to leave them out")
    with pytest.raises(ConfigError) as err:
        fit_prompts(make_task(), tokenizer, max_tokens=10, max_model_len=min(lengths) + 19, where="env.eval",
                    max_turns=2)
    assert str(err.value) == (f"no env.eval row fits inference_model.max_model_len={min(lengths) + 19}: the shortest "
                              f"prompt has {min(lengths)} tokens and a completion may take "
                              "inference_model.max_tokens=10 x env.max_steps=2 turns more; set "
                              f"inference_model.max_model_len to at least {min(lengths) + 20} or lower "
                              "inference_model.max_tokens")


def test_the_models_context_is_its_position_limit_unless_it_scales_rope(tiny_model_path, tmp_path):
    assert context_limit(tiny_model_path) == 2048
    config = {"max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_scaling": {"type": "yarn", "factor": 4}}))
    assert context_limit(tmp_path) is None  # vLLM derives the scaled context itself
    (tmp_path / "config.json").write_text(json.dumps({"text_config": config}))
    assert context_limit(tmp_path) == 4096
    assert context_limit(tmp_path / "missing") is None
