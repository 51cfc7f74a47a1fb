"""Rewards that are models: a sequence-classification reward model built in code, and an LLM judge behind a real
OpenAI-compatible HTTP server this module starts on localhost (retries, timeouts, concurrency, the API key)."""
import json
import math
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from helpers import SMALL, metric_rows, needs_vllm, run
from torchrl_grpo.core.errors import ConfigError, RunError
from torchrl_grpo.tasks import build_task

ROWS = [{"prompt": "Name a fruit.", "topic": "fruit"}, {"prompt": "Name a colour.", "topic": "colour"}]
SECRET = "secret-judge-key-123"


def write_rows(tmp_path, rows=ROWS):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ---------------------------------------------------------------------------------------------- reward model
@pytest.fixture(scope="module")
def reward_model_path(tmp_path_factory, tiny_model_path):
    """A Qwen2 sequence classifier with one output on the tiny model's tokenizer, random weights, built here."""
    from transformers import AutoConfig, AutoTokenizer, Qwen2ForSequenceClassification

    out = tmp_path_factory.mktemp("reward_model")
    config = AutoConfig.from_pretrained(tiny_model_path, num_labels=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen2ForSequenceClassification(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(out)
    return str(out)


def test_a_reward_model_scores_batches_as_each_pair_alone(tmp_path, reward_model_path):
    """Batched and padded (batch_size 2, pairs of different lengths, an odd count): each score is the model's
    output on that pair alone, unpadded (rendered with its chat template: the prompt, then the assistant turn)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    task = build_task({"dataset": "prompts", "data_path": write_rows(tmp_path),
                       "reward_model": {"path": reward_model_path, "batch_size": 2, "weight": 0.5,
                                        "device": "cpu"}})  # float32, as the forward it is compared with
    assert task.reward_weights == {"reward_model": 0.5}
    rows = [task.rows[0], task.rows[1], task.rows[0]]
    completions = ["Apple.", "A long answer: blue, or maybe green, or red.", "Pear"]
    scores = [s["reward_model"] for s in task.score_batch(completions, rows)]

    model = AutoModelForSequenceClassification.from_pretrained(reward_model_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(reward_model_path)
    for row, completion, score in zip(rows, completions, scores):
        text = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]},
                                              {"role": "assistant", "content": completion}], tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            alone = model(input_ids=ids).logits[0, 0].item()
        assert score == pytest.approx(alone, abs=1e-5)
    assert len(set(scores)) == 3


@pytest.mark.parametrize("spec, message", [
    ({"device": "cpu"}, r"^env.reward_model: give at least its path"),
    ({"path": "/nonexistent/rm"}, r"^env.reward_model.path=/nonexistent/rm: cannot load a sequence-classification"),
    ({"path": "x", "batchsize": 2}, r"^env.reward_model.batchsize: unknown key"),
])
def test_bad_reward_model_config_is_one_line(tmp_path, spec, message):
    with pytest.raises(ConfigError, match=message):
        build_task({"dataset": "prompts", "data_path": write_rows(tmp_path), "reward_model": spec})


# ----------------------------------------------------------------------------------------------------- judge
class JudgeServer(ThreadingHTTPServer):
    """POST /v1/chat/completions as OpenAI serves it. The reply depends on the completion in the request:
    ``flaky`` fails with 500 on its first request, ``slow`` answers after 3 s, ``mute`` gives no number,
    anything else gets its length (capped at 10) as the score. Counts requests and the most in flight at once."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), JudgeHandler)
        self.lock, self.requests, self.in_flight, self.most_in_flight = threading.Lock(), [], 0, 0
        self.authorizations = set()


class JudgeHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        content = body["messages"][0]["content"]
        completion = content.split("Response: ", 1)[1]
        with server.lock:
            server.requests.append(content)
            server.authorizations.add(self.headers.get("Authorization"))
            server.in_flight += 1
            server.most_in_flight = max(server.most_in_flight, server.in_flight)
            first_flaky = completion == "flaky" and sum("Response: flaky" in r for r in server.requests) == 1
        try:
            time.sleep(3.0 if completion == "slow" else 0.3)
            if first_flaky:
                return self._send(500, {"error": {"message": "busy"}})
            reply = "I cannot tell" if completion == "mute" else f"Score: {min(len(completion), 10)}"
            self._send(200, {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": reply}}]})
        finally:
            with server.lock:
                server.in_flight -= 1

    def _send(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def judge_server():
    server = JudgeServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


def judge_spec(server, **extra):
    return {"base_url": f"http://127.0.0.1:{server.server_address[1]}/v1", "model": "judge-model",
            "template": "Topic {topic}. Request: {prompt} Response: {completion}", "scale": 10,
            "timeout_s": 1.0, "max_retries": 1, "api_key_env": "JUDGE_KEY", **extra}


def test_a_judge_grades_concurrently_retries_and_counts_what_fails(tmp_path, judge_server, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", SECRET)
    task = build_task({"dataset": "prompts", "data_path": write_rows(tmp_path), "reward_errors": "zero",
                       "judge": judge_spec(judge_server)})
    completions = ["Apple", "Cherry", "flaky", "slow", "mute", "Blue"]
    rows = [task.rows[i % 2] for i in range(len(completions))]
    scores = [s["judge"] for s in task.score_batch(completions, rows)]
    assert scores == [0.5, 0.6, 0.5, 0.0, 0.0, 0.4]  # len/10; flaky retried; slow timed out (twice), mute: no score
    assert task.reward_error_count == 2
    assert judge_server.most_in_flight >= 4  # one batch's requests at once, not one after the other
    assert judge_server.authorizations == {f"Bearer {SECRET}"}  # the key from the environment
    assert "Topic colour. Request: Name a colour. Response: Cherry" in judge_server.requests  # the row's columns

    task.reward_errors = "raise"
    with pytest.raises(RunError, match=r"reward 'judge' .* raised ValueError: the judge's reply 'I cannot tell' has "
                                       r"no score"):
        task.score_batch(["mute"], [task.rows[0]])


@pytest.mark.parametrize("extra, message", [
    ({"template": "Grade {answer}"}, r"^env.judge.template: \{answer\}: a template fills \{completion\}"),
    ({"template": "Grade it"}, r"^env.judge.template: no \{completion\}"),
    ({"api_key_env": "sk-live-abc"}, r"^env.judge.api_key_env: give the name of the environment variable"),
    ({"model": None}, r"^env.judge: give at least base_url and model"),
    ({"timeout": 3}, r"^env.judge.timeout: unknown key"),
])
def test_bad_judge_config_is_one_line(tmp_path, judge_server, extra, message):
    with pytest.raises(ConfigError, match=message):
        build_task({"dataset": "prompts", "data_path": write_rows(tmp_path),
                    "judge": judge_spec(judge_server, **extra)})


@needs_vllm
def test_a_run_with_a_judge_and_a_reward_model_keeps_the_key_out_of_its_files(tmp_path, judge_server,
                                                                              reward_model_path):
    """grpo.py with both scorers beside the task's own rewards (weight 0: logged, not trained on): each logs its
    component every step; the API key, in the environment only, is in no file of the run directory."""
    spec = judge_spec(judge_server, weight=0.0, template="Response: {completion}")
    as_override = ",".join(f"{k}:'{v}'" if isinstance(v, str) else f"{k}:{v}" for k, v in spec.items())
    out = run([*SMALL, "train.total_dialog_turns=16", f"env.judge={{{as_override}}}",
               f"env.reward_model={{path: {reward_model_path}, weight: 0.0}}", "hydra.run.dir=run"], cwd=tmp_path,
              env_extra={"JUDGE_KEY": SECRET})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metric_rows(tmp_path / "run")
    assert len(rows) == 2 and all(math.isfinite(float(r["reward/reward_model"])) for r in rows)
    assert all(0 <= float(r["reward/judge"]) <= 1 for r in rows)
    assert len(judge_server.requests) == 16
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    assert SECRET not in out.stdout + out.stderr and os.environ.get("JUDGE_KEY") != SECRET
