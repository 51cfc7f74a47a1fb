"""How good is the model on a task: score responses with the task's rewards, or generate them first.

One code path serves ``evaluate.py`` and the trainer's evaluation every ``logging.eval_frequency`` steps:
:func:`generate_responses` (the rollout engine, on the task's evaluation split) then :func:`score_responses`.

Metrics: the mean of each reward component and of the weighted total over all responses (``reward/<name>``);
``solved`` and ``accuracy``, the count and the share of responses whose success component (``Task.success_reward``:
``accuracy`` for GSM8K and reasoning-gym, ``prompt_strict`` for IFEval) is >= 1; ``pass@k`` for k = 1, 2, 4, ... up to
the responses per prompt (and that count itself); for a task's pooled components (``Task.pooled``: IFEval's instruction
rewards, a share of each prompt's instructions) ``<name>/passed`` of ``<name>/checks`` over all responses and
their ratio ``<name>/pooled`` (IFEval's instruction-level accuracy); with the unbiased estimator of Chen et al. 2021
(2107.03374): ``pass@k = mean over prompts of 1 - C(n - c, k) / C(n, k)`` for n responses of which c solved; and the
same per task for rows that carry a ``task`` field (reasoning-gym).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from math import comb
from pathlib import Path
from typing import Any

from torchrl_grpo.config.settings import EvalSettings
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.episodes.play import play, turn_metrics
from torchrl_grpo.episodes.turn_envs import Turns
from torchrl_grpo.tasks import Task, per_task_means
from torchrl_grpo.tasks.scoring import nan_mean


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k responses drawn without replacement from n, c of which are
    correct, is correct: ``1 - C(n-c, k) / C(n, k)``."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 < k <= n and 0 <= c <= n (n={n}, c={c}, k={k})")
    return 1.0 - comb(n - c, k) / comb(n, k)


def ks_for(n: int) -> list[int]:
    """The k of the pass@k report for n responses per prompt: 1, 2, 4, ... below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def score_responses(task: Task, rows: Sequence[Mapping[str, Any]],
                    responses: Sequence[Sequence[str]]) -> tuple[dict, list[dict]]:
    """Metrics of ``responses[i]`` (the responses to ``rows[i]``, at least one each; pass@k up to the smallest
    count), and the scored records (the row's fields, ``response``, and ``scores``: each component and the
    weighted ``reward``) in row order."""
    if not rows or len(rows) != len(responses) or min(len(r) for r in responses) == 0:
        raise ValueError("score_responses needs one or more responses for each of one or more rows")
    success = task.success_reward
    scores = iter(task.score_batch([text for outs in responses for text in outs],
                                   [row for row, outs in zip(rows, responses) for _ in outs]))
    records, solved = [], []
    for row, outs in zip(rows, responses):
        solved.append(0)
        for text in outs:
            components = next(scores)
            solved[-1] += components[success] >= 1
            records.append({**row, "response": text, "scores": {**components, "reward": task.total(components)}})
    counts = [len(outs) for outs in responses]
    metrics = {
        "prompts": float(len(rows)), "responses": float(len(records)),
        "solved": float(sum(solved)), "accuracy": sum(solved) / len(records),
        **{f"pass@{k}": sum(pass_at_k(n, c, k) for n, c in zip(counts, solved)) / len(rows)
           for k in ks_for(min(counts))},
        **{f"reward{'' if key == 'reward' else '/' + key}": nan_mean(r["scores"][key] for r in records)
           for key in ["reward", *task.reward_names]},
    }
    flat_rows = [row for row, outs in zip(rows, responses) for _ in outs]
    for name, count in task.pooled.items():
        checks = [count(row) for row in flat_rows]
        passed = sum(round(r["scores"][name] * n) for r, n in zip(records, checks))
        metrics.update({f"{name}/passed": float(passed), f"{name}/checks": float(sum(checks)),
                        f"{name}/pooled": passed / max(1, sum(checks))})
    metrics.update(per_task_means(flat_rows, [{k: r["scores"][k] for k in task.reward_names} for r in records],
                                  [r["scores"]["reward"] for r in records], prefix=""))
    return metrics, records


def generate_responses(engine, task: Task, tokenizer, rows: Sequence[Mapping[str, Any]], *, samples: int,
                       max_tokens: int, temperature: float, top_p: float = 1.0, max_model_len: int | None = None,
                       turns: Turns = Turns()) -> tuple[list[list[str]], dict[str, float]]:
    """``samples`` completions of each row's prompt from ``engine`` (greedy when ``temperature`` is 0); for a
    multi-turn task (``turns``), ``samples`` episodes each and their last assistant turn (what the rewards judge),
    with the episodes' turn metrics (``turns/tool_calls`` and the other counts per episode; empty for one turn)."""
    rows = list(rows)
    played, _ = play(engine, tokenizer, task, rows, n=samples,
                     max_tokens=max_tokens, temperature=temperature, top_p=top_p, max_model_len=max_model_len,
                     turns=turns)
    counts = {} if turns.single else turn_metrics(played, turns.env.counters if turns.env else ())
    return [[p.text for p in played[i * samples: (i + 1) * samples]] for i in range(len(rows))], counts


def eval_rows(task: Task, num_prompts: int | None) -> list[dict]:
    """The first ``num_prompts`` rows of the evaluation split (all when None): the same prompts every time."""
    count = len(task.rows) if num_prompts is None else min(int(num_prompts), len(task.rows))
    return [task.rows[i] for i in range(count)]


def evaluate_with_engine(engine, task: Task, tokenizer, settings: EvalSettings,
                         turns: Turns = Turns()) -> tuple[dict, list[dict]]:
    """Generate on the evaluation split as ``settings`` say (num_prompts, samples, temperature, max_tokens; a
    multi-turn episode, as ``turns`` say, ends before ``max_model_len``) and score; what the trainer logs under
    ``eval/`` and ``evaluate.py`` prints (a multi-turn task's with its turn metrics, e.g. ``turns/tool_calls``)."""
    rows = eval_rows(task, settings.num_prompts)
    responses, counts = generate_responses(engine, task, tokenizer, rows, samples=settings.samples,
                                           max_tokens=settings.max_tokens, temperature=settings.temperature,
                                           max_model_len=settings.max_model_len, turns=turns)
    metrics, records = score_responses(task, rows, responses)
    return {**metrics, **counts}, records


def match_rows(prompts: Sequence[str], questions: Sequence[str]) -> list[int | None]:
    """For each prompt, the index of the row whose ``question`` is that text (None: no row's). Where the two
    line up row by row (as many prompts as rows, each one found at its own position, most found) every prompt
    takes its own row, so a slightly edited copy of a prompt still finds it: one of the GPT-4 responses
    published with IFEval has a prompt that differs from the input data's."""
    first: dict[str, int] = {}
    for i, question in enumerate(questions):
        first.setdefault(question, i)
    found = [first.get(prompt) for prompt in prompts]
    lined_up = (len(prompts) == len(questions) and 2 * sum(i is not None for i in found) > len(prompts)
                and all(i is None or questions[n] == prompt for n, (prompt, i) in enumerate(zip(prompts, found))))
    return list(range(len(prompts))) if lined_up else found


PROMPT_FIELDS = ("question", "prompt", "problem")  # ours, IFEval's, MATH's: how a response names its prompt


def read_responses(path: str | Path, task: Task) -> tuple[list[dict], list[list[str]]]:
    """Rows and their responses from a JSONL of ``{<dataset fields>, "response": str}`` (what ``evaluate.py``
    writes as ``eval_responses.jsonl``; its ``scores`` are ignored) or of ``{"question", "prompt" or "problem": str,
    "response": str}`` (IFEval's published responses, MATH's own fields), whose rows are found in ``task`` by
    :func:`match_rows`; responses with the same row are the responses to one prompt."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"eval.responses={path}: no such file; "
                          f"give a JSONL with one {{..., \"response\": ...}} a line")
    numbers, records = [], []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"eval.responses={path}: line {number} is not JSON ({err.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("response"), str):
                raise ConfigError(f"eval.responses={path}: line {number} has no string field \"response\"")
            numbers.append(number)
            records.append(record)
    if not records:
        raise ConfigError(f"eval.responses={path}: the file holds no response")
    if all(set(task.rows.column_names) <= record.keys() for record in records):
        rows = [{k: v for k, v in record.items() if k not in ("response", "scores")} for record in records]
    else:
        rows = [task.rows[i] for i in _find_rows(path, numbers, records, task)]
    groups: dict[str, tuple[dict, list[str]]] = {}
    for row, record in zip(rows, records):
        key = json.dumps(row, sort_keys=True, default=str)
        groups.setdefault(key, (row, []))[1].append(record["response"])
    return [row for row, _ in groups.values()], [outs for _, outs in groups.values()]


def _find_rows(path: Path, numbers: list[int], records: list[dict], task: Task) -> list[int]:
    """The index of each record's task row, found by its prompt text (the file lacks the rows' fields);
    ConfigError for the first record with no prompt text or one that finds no row."""
    prompts = []
    for number, record in zip(numbers, records):
        prompt = next((record[k] for k in PROMPT_FIELDS if isinstance(record.get(k), str)), None)
        if prompt is None:
            raise ConfigError(f"eval.responses={path}: line {number} has neither the fields of {task.name}'s "
                              f"rows ({', '.join(task.rows.column_names)}) nor a \"question\", \"prompt\" or "
                              "\"problem\" to find its row by")
        prompts.append(prompt)
    found = match_rows(prompts, [task.prompt_text(row) for row in task.rows])
    for number, prompt, i in zip(numbers, prompts, found):
        if i is None:
            raise ConfigError(
                f"eval.responses={path}: line {number}'s prompt {prompt[:60]!r}... is none of the {len(task.rows)} "
                f"prompts of {task.name}'s evaluation split; give responses to that split (env.data_path, "
                f"env.eval), or records with its rows' fields ({', '.join(task.rows.column_names)})")
    return found


def format_table(metrics: Mapping[str, float]) -> str:
    """The metrics as two aligned columns, for the console, then the counts behind the accuracies
    (``solved: 416/541 responses``, ``instruction_strict over all instructions: 697/834 = 0.8357``)."""
    width = max(len(k) for k in metrics)
    lines = [f"  {key:<{width}}  {value:10.4f}" for key, value in metrics.items()]
    lines.append(f"  solved: {metrics['solved']:.0f}/{metrics['responses']:.0f} responses")
    for key in metrics:
        if key.endswith("/pooled"):
            name = key.removesuffix("/pooled")
            lines.append(f"  {name} pooled over all checks: {metrics[name + '/passed']:.0f}/"
                         f"{metrics[name + '/checks']:.0f} = {metrics[key]:.4f}")
    return "\n".join(lines)


class Evaluator:
    """The trainer's evaluation (``logging.eval_frequency=N``): :func:`evaluate_with_engine` on the task's
    evaluation split before the first step (step 0), every N steps and after the last one; metrics under
    ``eval/`` and the time it took."""

    def __init__(self, task: Task, tokenizer, settings: EvalSettings, total_steps: int, turns: Turns = Turns()):
        self.task, self.tokenizer, self.settings, self.turns = task, tokenizer, settings, turns
        self.every, self.total_steps = settings.every, total_steps

    def due(self, step: int) -> bool:
        return self.every > 0 and (step == 0 or step % self.every == 0 or step == self.total_steps)

    def __call__(self, engine) -> dict:
        """Evaluate with ``engine``, which must hold the current weights."""
        import time

        started = time.perf_counter()
        metrics, _ = evaluate_with_engine(engine, self.task, self.tokenizer, self.settings, self.turns)
        return {**{f"eval/{k}": v for k, v in metrics.items()}, "eval_time": time.perf_counter() - started}
