"""The weight sync check (torchrl_grpo/engines/weight_check.py): its arithmetic on hand-made numbers, the probe's
log-probs against a softmax computed here, the real vLLM engine's score before and after a push, and a sync
run whose engine ignores pushes stopping with one line and a checkpoint."""
import copy

import datasets
import pytest
import torch

from helpers import cfg_with, metric_rows
from torchrl_grpo.collect.collector import Collector
from torchrl_grpo.config.spec import resolve_run
from torchrl_grpo.core.errors import RunError
from torchrl_grpo.engines.hf import TransformersEngine
from torchrl_grpo.engines.weight_check import (
    MOVED,
    Probe,
    WeightCheck,
    probe_ids,
    probe_log_probs,
    sync_problem,
    tolerance,
)
from torchrl_grpo.episodes.trajectories import PromptSampler
from torchrl_grpo.models.loading import load_policy, merged_state_dict
from torchrl_grpo.run.build import build_loss, build_optimizer, build_policy
from torchrl_grpo.run.loop import Run, run_loop
from torchrl_grpo.run.sources import LocalSource
from torchrl_grpo.run.state import RunState
from torchrl_grpo.tasks import Reward, Task
from torchrl_grpo.training.trainer import Trainer
from torchrl_grpo.training.weight_sync import ActorSync, EngineSync


class FixedScores:
    def __init__(self, scores):
        self.scores = scores

    def score(self, token_ids):
        return self.scores


def test_gap_is_the_mean_absolute_difference_and_the_limit_stops_nan_too():
    probe = Probe([7, 8, 9, 10], torch.tensor([-1.0, -2.0, -0.5]), limit=0.3)
    assert probe.gap(torch.tensor([-1.5, -1.75, -0.5])) == pytest.approx((0.5 + 0.25 + 0.0) / 3)
    gap, scores = probe.verify(FixedScores([-1.5, -1.75, -0.5]), before=None)
    assert gap == pytest.approx(0.25) and scores.tolist() == [-1.5, -1.75, -0.5]
    with pytest.raises(RunError, match=r"differ from the trainer's by 0\.333 on average \(limit 0\.3\)"):
        probe.verify(FixedScores([-2.0, -2.0, -0.5]), before=None)
    assert sync_problem(float("nan"), 0.3) and sync_problem(0.3, 0.3) is None


def test_a_push_that_changes_nothing_is_caught_within_the_gap_limit():
    """The engine's scores bit for bit those before the push while the trainer's moved: caught, though the gap
    (0.02) is far inside a bf16 engine's limit (0.1)."""
    before = torch.tensor([-1.0, -2.0, -0.5])
    moved = Probe([1, 2, 3, 4], before + 0.02, limit=0.1, trainer_moved=0.02)
    with pytest.raises(RunError, match=r"^weight sync check failed: after the push the engine's log-probs of the probe "
                                       r"text are unchanged, bit for bit, "
                                       r"while the trainer's moved by 0\.02 on average"):
        moved.verify(FixedScores(before.tolist()), before)
    nudged = (before + torch.tensor([0.0, 0.0, 1e-6])).tolist()  # any change at all: the push landed somewhere
    assert moved.verify(FixedScores(nudged), before)[0] == pytest.approx(0.02, abs=1e-6)
    assert moved.verify(FixedScores(before.tolist()), None)[0] == pytest.approx(0.02)  # nothing to compare with
    # the trainer barely moved: its update may have left every bf16 weight as it was
    still = Probe([1, 2, 3, 4], before + MOVED / 2, limit=0.1, trainer_moved=MOVED / 2)
    assert still.verify(FixedScores(before.tolist()), before)[0] == pytest.approx(MOVED / 2, rel=1e-4)


def test_each_probe_knows_how_far_the_trainer_moved_since_the_last_one(tokenizer):
    series = iter([torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.0]), torch.tensor([-1.5, -2.0])])
    check = WeightCheck(torch.nn.Linear(1, 1), tokenizer, torch.float32, None, log_probs=lambda ids: next(series))
    assert [check.probe().trainer_moved for _ in range(3)] == [0.0, 0.25, 0.0]


def test_tolerance_is_the_less_precise_dtypes_unless_configured():
    assert tolerance(torch.float32, torch.float32, None) == 5e-3
    assert tolerance(torch.bfloat16, torch.float32, None) == tolerance(torch.float32, torch.bfloat16, None) == 0.1
    assert tolerance(torch.float16, torch.float32, None) == 0.02
    assert tolerance(torch.bfloat16, torch.float32, 0.5) == 0.5


def test_probe_log_probs_are_each_tokens_softmax_given_its_prefix(tiny_model_path, tokenizer):
    model = load_policy(tiny_model_path, dtype=torch.float32, device="cpu", trainable=False)
    ids = probe_ids(tokenizer)
    assert len(ids) > 20
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    expected = [torch.log_softmax(logits[t - 1], -1)[ids[t]].item() for t in range(1, len(ids))]
    assert torch.allclose(probe_log_probs(model, ids).double(), torch.tensor(expected, dtype=torch.double), atol=1e-5)


def _noisy(model, scale=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.float().std().clamp(min=1e-3))
    return model


def test_vllm_engine_score_matches_the_trainer_before_and_after_a_push(vllm_engine, tiny_model_path, tokenizer):
    original = load_policy(tiny_model_path, dtype=torch.float32, device="cpu", trainable=False)
    check = WeightCheck(original, tokenizer, torch.float32, None)
    line = check.startup(vllm_engine)
    assert line.startswith("weight sync check: engine and trainer log-probs of a ") and "tolerance 0.005" in line
    assert check.after_push(vllm_engine) < 1e-4 and check.fault is None and check.limit == 5e-3
    sampling = vllm_engine.sampling_state()["torch"].clone()
    caller = torch.get_rng_state()
    vllm_engine.score(check.token_ids)
    assert torch.equal(vllm_engine.sampling_state()["torch"], sampling) and torch.equal(torch.get_rng_state(), caller)

    trained = _noisy(copy.deepcopy(original))
    moved = WeightCheck(trained, tokenizer, torch.float32, None).probe()
    assert sync_problem(moved.gap(moved.scores(vllm_engine)), check.limit)  # the engine holds the old weights: caught
    try:
        vllm_engine.push_weights(merged_state_dict(trained))
        assert moved.verify(vllm_engine, None)[0] < 1e-4
    finally:  # the session engine goes back to the original weights for the other tests
        vllm_engine.push_weights(merged_state_dict(original))


def digit_share(completion: str, row) -> float:
    return sum(ch.isdigit() for ch in completion) / max(1, len(completion))


class IgnoresPushes(TransformersEngine):
    """An engine whose weight push silently does nothing: the failure the check exists for."""

    def push_weights(self, state_dict):
        pass


@pytest.mark.parametrize("engine_dtype, why", [
    (torch.float32, "differ from the trainer's by"),  # the gap is above float32's limit at once
    (torch.bfloat16, "are unchanged, bit for bit"),  # far inside bf16's limit (0.1): the engine did not change
])
def test_a_run_whose_engine_ignores_pushes_stops_with_one_line_and_a_checkpoint(tiny_model_path, tokenizer, tmp_path,
                                                                                 engine_dtype, why):
    """At the first push, whatever the engine's dtype."""
    cfg = cfg_with("model=tiny", "env.num_envs=4", "env.repeats=4", "train.optim_batch_size=16",
                   "train.total_dialog_turns=320", "inference_model.max_tokens=8", "optimizer.lr=3e-4",
                   "logging.progress_bar=false", "logging.checkpoint_frequency=0")
    torch.manual_seed(0)
    rows = datasets.Dataset.from_dict({"question": [f"Say some numbers, {i}." for i in range(16)],
                                       "answer": ["0"] * 16})
    task = Task("digits", rows, system_prompt=None, rewards=[Reward("digits", digit_share)])
    spec = resolve_run(cfg)
    policy = build_policy(spec.model, tiny_model_path, ["cpu"], torch.float32)
    trainer = Trainer(policy, None, build_loss(spec.loss, policy), build_optimizer(spec.optimizer, policy), spec.train,
                      torch.device("cpu"), None)
    engine = IgnoresPushes(copy.deepcopy(policy), tokenizer, seed=0)
    check = WeightCheck(policy, tokenizer, engine_dtype, None)
    assert "warning" not in check.startup(engine)
    collector = Collector(task, tokenizer, engine, PromptSampler(len(rows), 0), resolve_run(cfg).collect)
    source = LocalSource(collector, EngineSync(trainer, collector.engine, check))
    run = Run(source, trainer, RunState(resolve_run(cfg), tmp_path), resolve_run(cfg))
    with pytest.raises(RunError) as stopped:
        run_loop(run)
    message = str(stopped.value)
    assert message.startswith("weight sync check failed: after the push the engine's log-probs of the probe text "
                              f"{why}")
    assert "\n" not in message
    logged = metric_rows(tmp_path)
    assert len(logged) == 1 and "checkpoint of step 1 saved" in message  # stopped at the first push
    assert 5e-3 < float(logged[0]["weight_sync_gap"]) < 0.1
    assert (tmp_path / "checkpoints" / "step_000001" / "trainer_state.pt").is_file()


class Recording(TransformersEngine):
    """The transformers engine, recording the loop's calls to it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def generate(self, *args, **kwargs):
        self.calls.append("generate")
        return super().generate(*args, **kwargs)

    def push_weights(self, state_dict):
        self.calls.append("push")
        super().push_weights(state_dict)

    def sleep(self):
        self.calls.append("sleep")


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "sync_iter_false"])
def test_the_loop_lets_its_engine_sleep_from_its_last_generation_to_the_next_push(tiny_model_path, tokenizer,
                                                                                 tmp_path, overlap):
    """Each step: the engine generates the batch, sleeps while the trainer trains, then takes the push. With
    train.sync_iter=false it generates the next batch meanwhile, and is never asked to sleep."""
    cfg = cfg_with("model=tiny", "env.num_envs=2", "env.repeats=2", "train.optim_batch_size=4",
                   "train.total_dialog_turns=8", "inference_model.max_tokens=4", "logging.progress_bar=false",
                   "logging.checkpoint_frequency=0")
    rows = datasets.Dataset.from_dict({"question": [f"Say some numbers, {i}." for i in range(4)], "answer": ["0"] * 4})
    task = Task("length", rows, system_prompt=None, rewards=[Reward("length", lambda c, row: float(len(c)))])
    spec = resolve_run(cfg)
    policy = build_policy(spec.model, tiny_model_path, ["cpu"], torch.float32)
    trainer = Trainer(policy, None, build_loss(spec.loss, policy), build_optimizer(spec.optimizer, policy), spec.train,
                      torch.device("cpu"), None)
    engine = Recording(copy.deepcopy(policy), tokenizer, seed=0)
    collector = Collector(task, tokenizer, engine, PromptSampler(len(rows), 0), resolve_run(cfg).collect)
    run = Run(LocalSource(collector, EngineSync(trainer, engine), overlap=overlap), trainer,
              RunState(resolve_run(cfg), tmp_path), resolve_run(cfg))
    run_loop(run)
    steps = "".join({"generate": "g", "sleep": "s", "push": "p"}[call] for call in engine.calls)
    assert steps == ("gspgsp" if not overlap else "ggpp"), engine.calls


def test_a_step_that_took_no_update_pushes_nothing():
    """The engine already has the weights of a step whose optimizer steps were all without signal (or skipped):
    no push, no check, no push metrics; the next update is pushed again, and so are the same weights to an engine
    that dropped its own while it slept."""
    pushes = []

    class Counting:
        policy = torch.nn.Linear(1, 1, bias=False)  # not the engine's model: the engine takes pushes
        parallel = None
        updates = 0

    class Engine:
        needs_weights = False

        def push_weights(self, weights):
            pushes.append(weights["weight"].item())

    trainer, engine = Counting(), Engine()
    sync = EngineSync(trainer, engine)
    assert sync.push(0) == {} and pushes == []
    trainer.updates = 1
    trainer.policy.weight.data.fill_(1.0)
    assert "weight_push_time" in sync.push(1) and pushes == [1]
    assert sync.push(2) == {} and pushes == [1]
    engine.needs_weights = True  # it slept at level 2: the same weights are pushed again
    assert "weight_push_time" in sync.push(3) and pushes == [1, 1]


def test_actors_get_no_push_and_no_new_version_after_a_step_without_update():
    """The async sync: nothing to send (and so no policy version that would count the actors' batches stale) while
    the trainer's weights are those the actors hold; a resume's weights count as held."""
    sent = []

    class Trainer:
        policy = torch.nn.Linear(1, 1, bias=False)  # its one weight: the update count
        parallel = None
        updates = 0

    class Pool:
        version = 0

        def push(self, weights, version, probe):
            sent.append((weights["weight"].item(), version))

        def settle_pushes(self):
            sent.append("settled")

    trainer = Trainer()
    sync = ActorSync(trainer)
    sync.attach(Pool())
    assert not sync.changed
    trainer.updates = 2
    trainer.policy.weight.data.fill_(2.0)
    assert sync.changed
    assert "weight_push_time" in sync.push(1) and sent == [(2, 1)] and not sync.changed
    trainer.updates = 3
    trainer.policy.weight.data.fill_(3.0)
    sync.resume()
    assert not sync.changed and sent == [(2, 1), (3, 0), "settled"]
