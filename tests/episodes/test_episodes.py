"""Multi-turn episodes token in, token out (torchrl_grpo/episodes/play.py): a scripted policy (fixed ids) through
three turns with feedback in between, on the tiny model's and SmolLM2's ChatML templates. The episode's ids
must be what the whole conversation renders and tokenizes to, the loss mask exactly the sampled ids, the
log-probs at their places; sampled ids that text would not give back are kept as sampled."""
import pytest

from torchrl_grpo.core.errors import RunError
from torchrl_grpo.episodes.episode import Episode, inserted_ids
from torchrl_grpo.models.loading import load_tokenizer
from torchrl_grpo.models.sources import resolve_model

FEEDBACK = {"role": "user", "content": "Wrong, try again."}


@pytest.fixture(params=["tiny", "smollm2-135m-instruct"])
def chatml(request):
    return load_tokenizer(resolve_model(request.param))


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render(tokenizer, messages, generation_prompt):
    return ids(tokenizer, tokenizer.apply_chat_template(messages, tokenize=False,
                                                        add_generation_prompt=generation_prompt))


def play(tokenizer, answers, stop_sampled):
    """The scripted episode: each answer's ids (then the stop token, if ``stop_sampled``), feedback after each
    but the last. Returns the episode and the positions and log-probs of the sampled ids."""
    conversation = [{"role": "user", "content": "What is 3 + 4?"}]
    episode = Episode.start(render(tokenizer, conversation, True))
    positions, log_probs = [], []
    for turn, answer in enumerate(answers):
        sampled = ids(tokenizer, answer) + ([tokenizer.convert_tokens_to_ids("<|im_end|>")] if stop_sampled else [])
        scores = [-0.5 - turn - 0.01 * k for k in range(len(sampled))]
        positions += range(len(episode.tokens), len(episode.tokens) + len(sampled))
        log_probs += scores
        episode.add_sampled(sampled, scores)
        conversation.append({"role": "assistant", "content": answer})
        if turn < len(answers) - 1:
            episode.add_inserted(inserted_ids(tokenizer, conversation, [FEEDBACK], sampled))
            conversation.append(FEEDBACK)
    return episode, conversation, positions, log_probs


@pytest.mark.parametrize("stop_sampled", [True, False], ids=["stopped", "cut-at-max-tokens"])
def test_a_scripted_three_turn_episode_is_the_rendered_conversation(chatml, stop_sampled):
    episode, conversation, positions, log_probs = play(chatml, ["5", "6", "7"], stop_sampled)
    whole = render(chatml, conversation, False)  # ... "<|im_end|>\n" after the last answer
    assert episode.tokens == whole[: len(episode.tokens)]
    end = ids(chatml, "<|im_end|>\n")
    assert whole[len(episode.tokens):] == (end[1:] if stop_sampled else end)
    assert [i for i, s in enumerate(episode.sampled) if s] == positions and episode.turns == 3
    assert [episode.log_probs[i] for i in positions] == log_probs
    assert all(episode.log_probs[i] == 0.0 for i, s in enumerate(episode.sampled) if not s)
    # what was inserted: the feedback turns and, where the engine was cut, the end of each of its turns
    inserted = [t for t, s in zip(episode.tokens, episode.sampled) if not s]
    im_end = chatml.convert_tokens_to_ids("<|im_end|>")
    assert chatml.decode(inserted).count("Wrong, try again.") == 2
    assert inserted.count(im_end) == (render(chatml, conversation[:1], True).count(im_end) + 2
                                      + (0 if stop_sampled else 2))


def test_sampled_ids_are_kept_as_sampled_not_as_text_would_give_them(chatml):
    split = chatml.convert_tokens_to_ids(list("hello"))  # one id a letter: the text "hello" tokenizes to fewer
    assert chatml.unk_token_id not in split and chatml.decode(split) == "hello" and ids(chatml, "hello") != split
    prompt = render(chatml, [{"role": "user", "content": "Say hello."}], True)
    episode = Episode.start(prompt)
    episode.add_sampled(split, [-1.0] * 5)
    conversation = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "hello"}]
    episode.add_inserted(inserted_ids(chatml, conversation, [FEEDBACK], split))
    assert episode.tokens[len(prompt): len(prompt) + 5] == split and sum(episode.sampled) == 5
    assert chatml.decode(episode.tokens[len(prompt) + 5:]).startswith("<|im_end|>\n<|im_start|>user\nWrong")


@pytest.mark.parametrize("template, message", [
    ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
     "{% if add_generation_prompt %}assistant:{% endif %}", "end of an assistant turn is not a token of its own"),
    ("{% for m in messages %}{% if m['role'] != 'assistant' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
     "<|im_end|>\n{% endif %}{% endfor %}", "drops the assistant's text of the last turn"),
])
def test_templates_that_cannot_be_extended_token_by_token_are_refused(chatml, template, message):
    chatml.chat_template = template
    conversation = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    with pytest.raises(RunError, match=message):
        inserted_ids(chatml, conversation, [FEEDBACK], ids(chatml, "A"))


def test_mismatched_log_probs_and_a_conversation_not_ending_with_the_assistant_are_errors(chatml):
    with pytest.raises(ValueError, match="2 sampled ids but 1 log-probs"):
        Episode.start([1]).add_sampled([2, 3], [-1.0])
    with pytest.raises(ValueError, match="must end with the assistant's turn"):
        inserted_ids(chatml, [{"role": "user", "content": "Q"}], [FEEDBACK], [])


# Qwen3's switch, on a ChatML template: `enable_thinking=false` opens each assistant turn with an empty think block
THINKING_SWITCH = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_template_of_prompts_and_inserted_turns():
    """env.chat_template_kwargs on the task, passed wherever a prompt or a turn is rendered (the rollout, the
    length check and evaluation take prompt_token_ids; multi-turn episodes inserted_ids)."""
    from torchrl_grpo.core.errors import ConfigError
    from torchrl_grpo.episodes.trajectories import prompt_token_ids
    from torchrl_grpo.tasks import build_task

    tokenizer = load_tokenizer(resolve_model("tiny"))
    tokenizer.chat_template = THINKING_SWITCH
    env = {"dataset": "gsm_symbolic", "size": 4, "system_prompt": ""}
    plain, switched = build_task(env), build_task({**env, "chat_template_kwargs": {"enable_thinking": False}})
    assert plain.chat_template_kwargs == {} and switched.chat_template_kwargs == {"enable_thinking": False}
    row = plain.rows[0]
    question = f"<|im_start|>user\n{row['question']}<|im_end|>\n<|im_start|>assistant\n"
    assert prompt_token_ids(plain, tokenizer, [row]) == [ids(tokenizer, question)]
    assert prompt_token_ids(switched, tokenizer, [row]) == [ids(tokenizer, question + "<think>\n\n</think>\n\n")]
    conversation = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tail = inserted_ids(tokenizer, conversation, [FEEDBACK], [im_end], switched.chat_template_kwargs)
    assert tokenizer.decode(tail).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not tokenizer.decode(inserted_ids(tokenizer, conversation, [FEEDBACK], [im_end])).endswith("</think>\n\n")
    with pytest.raises(ConfigError, match=r"^env.chat_template_kwargs=\['x'\]: give a mapping"):
        build_task({**env, "chat_template_kwargs": ["x"]})
