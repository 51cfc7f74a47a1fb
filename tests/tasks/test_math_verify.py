"""MATH answers checked by math-verify (torchrl_grpo/tasks/symbolic.py), with the normaliser as the fallback:
a table of equivalent and different answers, which of the two decided, and the check off the main thread
(math-verify's signal timeouts work only on it), a stuck check included."""
import threading
import time

import pytest

from torchrl_grpo.tasks.competition_math import accuracy, decided_by_math_verify
from torchrl_grpo.tasks.symbolic import check_in_helper, math_verify_equal

SAME = [
    ("\\sqrt{8}", "2\\sqrt{2}"), ("\\frac{1}{2}", "0.5"), ("\\dfrac{3}{6}", "\\frac{1}{2}"), ("2^{10}", "1024"),
    ("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}"), ("(x+1)^2", "x^2+2x+1"), ("\\{1, 2, 3\\}", "\\{3, 2, 1\\}"),
    ("[0, 1)", "[0,1)"), ("\\pi", "\\pi"), ("2\\pi", "\\pi \\cdot 2"), ("10\\%", "10"), ("90^\\circ", "90"),
    ("\\frac{6}{4}", "1.5"), ("-\\frac{3}{4}", "-0.75"), ("1{,}000", "1000"), ("\\sqrt{18}", "3\\sqrt{2}"),
    ("x = 3", "3"), ("\\infty", "\\infty"), ("\\frac{10}{4}", "\\frac{5}{2}"), ("\\log_2 8", "3"),
]
DIFFERENT = [
    ("\\sqrt{8}", "3\\sqrt{2}"), ("\\frac{1}{3}", "0.33"), ("(1, 2)", "(2, 1)"), ("[0, 1)", "[0, 1]"),
    ("\\{1, 2\\}", "\\{1, 2, 3\\}"), ("x^2", "x^3"), ("2", "3"), ("\\pi", "3.14"), ("-1", "1"),
    ("(x+1)^2", "x^2+1"), ("\\frac{1}{2}", "2"), ("\\sqrt{2}", "2"),
]


@pytest.mark.parametrize("predicted, gold", SAME)
def test_equivalent_answers_are_right(predicted, gold):
    row = {"answer": gold}
    assert accuracy(f"So the answer is $\\boxed{{{predicted}}}$.", row) == 1.0
    assert decided_by_math_verify(f"\\boxed{{{predicted}}}", row) == 1.0


@pytest.mark.parametrize("predicted, gold", DIFFERENT)
def test_different_answers_are_wrong(predicted, gold):
    assert accuracy(f"\\boxed{{{predicted}}}", {"answer": gold}) == 0.0


def test_the_fallback_decides_what_math_verify_cannot_parse_and_says_so():
    row = {"answer": "\\ldots"}
    assert math_verify_equal("\\ldots", "\\ldots") is None  # math-verify parses it to nothing
    assert accuracy("\\boxed{\\ldots}", row) == 1.0 and decided_by_math_verify("\\boxed{\\ldots}", row) == 0.0
    assert decided_by_math_verify("no answer", row) is None  # not applicable: left out of the logged share


def test_off_the_main_thread_the_check_runs_in_a_helper_process():
    """From a thread (the prefetch thread's case) math-verify's signal timeouts cannot run here: the verdicts come
    from the helper process, the same as on the main thread."""
    pairs = [("\\sqrt{50}", "5\\sqrt{2}"), ("\\frac{2}{3}", "0.6")]
    results = {}

    def work():
        results["thread"] = [accuracy(f"\\boxed{{{p}}}", {"answer": g}) for p, g in pairs]

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=120)
    assert results["thread"] == [1.0, 0.0]


def stuck(predicted, gold):
    time.sleep(60)  # a check stuck in sympy


def test_a_stuck_check_in_the_helper_is_killed_and_falls_back():
    assert check_in_helper(stuck, "1", "1", timeout_s=2.0) is None
    assert check_in_helper(pow, 2, 10, timeout_s=60.0) == 1024  # a fresh helper takes the next check


def test_evaluate_reads_responses_that_carry_maths_own_fields(tmp_path):
    """Responses saved with MATH's fields (problem, solution: another tool's output) find their rows by the
    problem and are scored by math-verify."""
    import json

    from torchrl_grpo.run.evaluation import read_responses, score_responses
    from torchrl_grpo.tasks import build_task

    rows = [{"problem": "Simplify $\\sqrt{8}$.", "solution": "$\\boxed{2\\sqrt{2}}$", "type": "Algebra",
             "level": "Level 1"},
            {"problem": "What is $1+1$?", "solution": "$\\boxed{2}$", "type": "Prealgebra", "level": "Level 1"}]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = build_task({"dataset": "math", "data_path": str(tmp_path), "split": "test"})
    responses = tmp_path / "responses.jsonl"
    responses.write_text("".join(json.dumps({**r, "response": answer}) + "\n" for r, answer in
                                 zip(rows, ["It is $\\boxed{\\sqrt{8}}$.", "$\\boxed{3}$"])))
    metrics, records = score_responses(task, *read_responses(responses, task))
    assert [r["scores"]["accuracy"] for r in records] == [1.0, 0.0] and metrics["reward/math_verify"] == 1.0
