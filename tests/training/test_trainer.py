"""Trainer.prepare, the policy-dependent half of a step that every mode runs (sync, prefetch, async): the
trainer's and the reference's log-probs, the KL penalty in the reward and the group advantages, each
recomputed here by hand on a hand-made batch."""
import dataclasses

import pytest
import torch
from tensordict import TensorDict

from torchrl_grpo.config.settings import OptimizerSettings, TrainSettings
from torchrl_grpo.core.batch import check_batch
from torchrl_grpo.objective.loss import GRPOLoss, LossRows
from torchrl_grpo.training.micro_batches import by_length
from torchrl_grpo.training.trainer import Trainer

VOCAB = 7


class TableLM(torch.nn.Module):
    """A bigram "language model": the logits after token a are row a of a fixed table."""

    def __init__(self, seed: int):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)))
        self.head = torch.nn.Identity()  # the "hidden state" is already the logits row

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, attention_mask, logits_to_keep, use_cache=False):
        return type("Out", (), {"logits": self.head(self.table[input_ids][:, -logits_to_keep:])})


def by_hand(model: TableLM, tokens, mask, temperature):
    """log pi(token_t | token_{t-1}) at the masked positions, 0 elsewhere."""
    out = torch.zeros(tokens.shape)
    for i in range(tokens.shape[0]):
        for t in range(1, tokens.shape[1]):
            if mask[i, t]:
                out[i, t] = torch.log_softmax(model.table[tokens[i, t - 1]].detach() / temperature, -1)[tokens[i, t]]
    return out


def make_batch():
    tokens = torch.tensor([[1, 2, 3, 4, 0], [1, 2, 5, 0, 0], [3, 3, 6, 6, 2], [3, 3, 1, 0, 0]])
    attention = tokens != 0
    attention[2] = True
    completion = attention.clone()
    completion[:, :2] = False  # two prompt tokens each
    sample = torch.where(completion, -torch.rand(tokens.shape, generator=torch.Generator().manual_seed(3)), 0.0)
    return TensorDict({"tokens": tokens, "attention_mask": attention, "completion_mask": completion,
                       "sample_log_probs": sample, "old_log_probs": sample.clone(),
                       "reward": torch.tensor([1.0, 0.0, 0.5, 0.5])}, batch_size=[4])


SETTINGS = TrainSettings(group_size=2, micro_batch=1, accumulation=1, epochs=1, temperature=0.7,
                         recompute_old_log_probs=True, kl_in_reward_coeff=0.1, reward_scale="group",
                         clip_grad_norm=None, mixed_precision=False, max_nonfinite_updates=3, seed=0)


def test_prepare_adds_log_probs_kl_penalty_and_advantages():
    policy, ref, batch = TableLM(1), TableLM(2), make_batch()
    trainer = Trainer(policy, ref, loss=GRPOLoss(policy), optimizer=None, settings=SETTINGS,
                      device=torch.device("cpu"), ref_device=torch.device("cpu"))
    sample, reward = batch["sample_log_probs"].clone(), batch["reward"].clone()
    metrics = trainer.prepare(batch)

    mask = batch["completion_mask"]
    torch.testing.assert_close(batch["old_log_probs"], by_hand(policy, batch["tokens"], mask, 0.7))
    ref_lp = by_hand(ref, batch["tokens"], mask, 0.7)
    torch.testing.assert_close(batch["ref_log_probs"], ref_lp)
    kl = ((sample - ref_lp) * mask).sum(-1)  # k1 summed over each completion
    expected_reward = reward - 0.1 * kl
    torch.testing.assert_close(batch["reward"], expected_reward)
    groups = expected_reward.double().view(2, 2)
    expected_adv = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)
    torch.testing.assert_close(batch["advantage"], expected_adv.view(-1).float())
    assert metrics["kl_penalty_in_reward"] == torch.tensor(kl.mean().item()).item()
    assert metrics["engine_trainer_logp_gap_max"] > 0  # the batch's sample log-probs are not the policy's
    assert trainer.loss.rows(batch).signal.all()  # no group ties once the KL penalty is in the reward


def test_a_prepared_batch_has_the_dtypes_and_shapes_of_core_batch():
    policy, ref, batch = TableLM(1), TableLM(2), make_batch()
    Trainer(policy, ref, loss=GRPOLoss(policy), optimizer=None, settings=SETTINGS, device=torch.device("cpu"),
            ref_device=torch.device("cpu")).prepare(batch)
    assert {"ref_log_probs", "advantage"} <= set(batch.keys())
    check_batch(batch)


def test_signal_fraction_counts_completions_with_an_advantage_and_a_loss_token():
    policy, batch = TableLM(1), make_batch()
    batch["reward"] = torch.tensor([0.5, 0.5, 1.0, 0.0])  # the first group ties
    batch["truncated"] = torch.tensor([False, False, True, False])
    settings = dataclasses.replace(SETTINGS, kl_in_reward_coeff=0.0)
    for overlong, expected in (("none", 0.5), ("mask", 0.25)):  # masked: row 2's tokens leave the loss
        trainer = Trainer(policy, None, loss=GRPOLoss(policy, overlong=overlong),
                          optimizer=torch.optim.SGD(policy.parameters(), lr=0.0), settings=settings,
                          device=torch.device("cpu"), ref_device=torch.device("cpu"))
        prepared = batch.clone()
        trainer.prepare(prepared)
        assert trainer.optimize(prepared)["signal_fraction"] == expected


def test_the_no_signal_watch_names_the_cause_every_patience_steps_and_resets():
    from torchrl_grpo.training.no_signal import NoSignalWatch

    watch = NoSignalWatch(patience=2, min_ess=0.5, stop=False)
    silent = {"signal_fraction": 0.0, "tied_group_fraction": 1.0, "reward": 0.0, "ess": 1.0}
    said = [watch.observe(silent) for _ in range(5)]
    assert [s is not None for s in said] == [False, True, False, True, False]
    assert said[1].startswith("no completion carried a learning signal for 2 steps in a row: every group's rewards "
                              "tied (mean reward 0)") and "loss.dynamic_sampling=true" in said[1]
    assert "for 4 steps" in said[3] and watch.stop_reason(silent) is None
    assert watch.observe({**silent, "signal_fraction": 0.25}) is None and watch.cause(silent) is None  # reset
    masked = {**silent, "tied_group_fraction": 0.5}
    watch.observe(masked)
    assert "loss.overlong=mask" in watch.observe(masked)
    collapsed = {"signal_fraction": 1.0, "ess": 0.2}
    stopping = NoSignalWatch(patience=3, min_ess=0.5, stop=True)
    assert [stopping.observe(collapsed) is not None for _ in range(3)] == [False, False, True]
    assert stopping.stop_reason(collapsed).startswith("the importance weights collapsed for 3 steps in a row (ess "
                                                      "0.2 < train.min_ess=0.5)")
    assert NoSignalWatch(patience=0, min_ess=0.5, stop=True).observe(silent) is None  # 0 watches nothing


def test_log_probs_do_not_depend_on_the_micro_batch_size():
    policy = TableLM(1)
    whole = Trainer(policy, None, None, None, dataclasses.replace(SETTINGS, micro_batch=4), torch.device("cpu"), None)
    split = Trainer(policy, None, None, None, SETTINGS, torch.device("cpu"), None)
    batch = make_batch()
    torch.testing.assert_close(whole.log_probs(policy, torch.device("cpu"), batch),
                               split.log_probs(policy, torch.device("cpu"), batch))


def test_no_reference_means_no_kl_penalty_and_engine_log_probs_stay():
    batch = make_batch()
    settings = dataclasses.replace(SETTINGS, recompute_old_log_probs=False, kl_in_reward_coeff=0.0)
    metrics = Trainer(TableLM(1), None, GRPOLoss(TableLM(1)), None, settings, torch.device("cpu"), None).prepare(batch)
    assert torch.equal(batch["old_log_probs"], batch["sample_log_probs"])
    assert "ref_log_probs" not in batch.keys() and "kl_penalty_in_reward" not in metrics
    assert torch.equal(batch["reward"], make_batch()["reward"])


class PoisonedLoss(torch.nn.Module):
    """A loss whose gradient is NaN while ``poisoned`` is set (what an overflow or a 0/0 does)."""

    def __init__(self, policy):
        super().__init__()
        self.policy, self.poisoned = policy, True

    def rows(self, batch) -> LossRows:
        every = torch.ones(len(batch), dtype=torch.bool)
        return LossRows(batch["completion_mask"], every, every, "constant_sum")  # each row weighs 1

    def forward(self, batch):
        scale = torch.tensor(float("nan") if self.poisoned else 1.0)
        loss = (self.policy.table.sum() * scale).reshape(())
        zero = torch.zeros(())
        return TensorDict({"loss_objective": loss, "clip_fraction_low": zero, "clip_fraction_high": zero,
                           "ratio_max": zero + 1}, batch_size=[])


def test_a_streak_of_non_finite_updates_is_a_divergence_one_finite_update_resets_it():
    policy = TableLM(1)
    before = policy.table.detach().clone()
    loss = PoisonedLoss(policy)
    settings = dataclasses.replace(SETTINGS, micro_batch=4)  # one optimizer step per optimize call
    trainer = Trainer(policy, None, loss, torch.optim.SGD(policy.parameters(), lr=0.1), settings,
                      torch.device("cpu"), None)
    for streak in (1, 2):
        assert trainer.optimize(make_batch())["skipped_updates"] == 1 and trainer.divergence() is None
        assert trainer.nonfinite_streak == streak and torch.equal(policy.table, before)  # skipped: weights intact
    loss.poisoned = False
    trainer.optimize(make_batch())
    assert trainer.nonfinite_streak == 0 and not torch.equal(policy.table, before)
    loss.poisoned = True
    for _ in range(3):
        trainer.optimize(make_batch())
    message = trainer.divergence()
    assert message.startswith("3 updates in a row had a non-finite gradient norm and were skipped "
                              "(train.max_nonfinite_updates=3); likely causes: a learning rate too high "
                              "(optimizer.lr=0.1)")
    never = Trainer(policy, None, loss, torch.optim.SGD(policy.parameters(), lr=0.1),
                    dataclasses.replace(settings, max_nonfinite_updates=0), torch.device("cpu"), None)
    for _ in range(4):
        never.optimize(make_batch())
    assert never.divergence() is None


@pytest.mark.parametrize("regulariser", [None, "entropy_coeff", "kl_to_inference_coeff"])
def test_an_update_without_signal_is_not_taken_and_moves_neither_weights_nor_adam_nor_the_schedule(regulariser):
    """Tied rewards, no regulariser: each optimizer step's rows all have advantage 0, so their loss and its gradient
    are exactly 0. No backward runs and no step is taken (AdamW's momentum and weight decay would otherwise move the
    weights): weights, AdamW's state and the learning rate stand still; the diagnostics come from the forward. A
    regulariser acts on every token: then every step is taken."""
    policy = TableLM(1)
    loss = GRPOLoss(policy, temperature=0.7, **({regulariser: 0.1} if regulariser else {}))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=0.1, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1 / (1 + k))
    settings = dataclasses.replace(SETTINGS, kl_in_reward_coeff=0.0, micro_batch=2)  # two optimizer steps
    trainer = Trainer(policy, None, loss, optimizer, settings, torch.device("cpu"), None, scheduler=scheduler)
    moving = make_batch()
    trainer.prepare(moving)
    trainer.optimize(moving)  # a step with signal first: AdamW has momentum and a step count
    state = {k: v.clone() for k, v in optimizer.state[policy.table].items()}
    weights, lr = policy.table.detach().clone(), optimizer.param_groups[0]["lr"]
    tied = make_batch()
    tied["reward"] = torch.tensor([0.5, 0.5, 1.0, 1.0])
    trainer.prepare(tied)
    metrics = trainer.optimize(tied)
    assert metrics["loss_objective"] == 0.0 and metrics["entropy"] > 0
    if regulariser is None:  # nothing moved between the step's two windows: ratios of 1
        assert metrics["still_updates"] == 2 and metrics["grad_norm"] == 0.0 and metrics["ratio_mean"] == 1.0
        assert torch.equal(policy.table, weights) and optimizer.param_groups[0]["lr"] == lr
        assert all(torch.equal(optimizer.state[policy.table][k], v) for k, v in state.items())
    else:
        assert metrics["still_updates"] == 0 and metrics["grad_norm"] > 0
        assert not torch.equal(policy.table, weights) and optimizer.param_groups[0]["lr"] < lr
        assert optimizer.state[policy.table]["step"] == state["step"] + 2


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant_sum"])
@pytest.mark.parametrize("micro_batch, trained", [(1, 2), (2, 2), (4, 4)])
def test_rows_without_signal_skip_the_forward_and_the_update_is_the_one_computing_them_gives(aggregation,
                                                                                              micro_batch, trained):
    """Rows 2 and 3 tie (advantage 0): they skip the forward and backward as far as whole micro-batches allow
    (micro-batches of 4: filled up with them), yet count in the aggregation, so that the update is the one
    computing every row gives (to float rounding: other micro-batches, other sums)."""
    results = {}
    for skip in (True, False):
        policy = TableLM(1)
        rows_seen = []
        forward = policy.forward
        policy.forward = lambda input_ids, **kw: rows_seen.append(len(input_ids)) or forward(input_ids, **kw)
        loss = GRPOLoss(policy, aggregation=aggregation, aggregation_constant=5.0, temperature=0.7)
        if not skip:  # every row computed
            asked = loss.rows
            loss.rows = lambda batch: dataclasses.replace(asked(batch), moving=torch.ones(len(batch), dtype=torch.bool))
        settings = dataclasses.replace(SETTINGS, kl_in_reward_coeff=0.0, micro_batch=micro_batch,
                                       accumulation=4 // micro_batch)
        trainer = Trainer(policy, None, loss, torch.optim.SGD(policy.parameters(), lr=1.0), settings,
                          torch.device("cpu"), None)
        batch = make_batch()
        trainer.prepare(batch)
        metrics = trainer.optimize(batch)
        results[skip] = policy.table.detach(), metrics, sum(rows_seen)
    (fast, fast_metrics, fast_rows), (slow, slow_metrics, slow_rows) = results[True], results[False]
    assert (fast_rows, slow_rows) == (trained, 4) and fast_metrics["trained_row_fraction"] == trained / 4
    assert slow_metrics["trained_row_fraction"] == 1.0
    assert not torch.equal(slow, TableLM(1).table.detach())
    torch.testing.assert_close(fast, slow, atol=1e-6, rtol=0)


def test_moving_rows_are_those_with_an_advantage_and_a_loss_token_or_any_token_under_a_regulariser():
    batch = make_batch()
    batch["advantage"] = torch.tensor([0.0, 1.0, -2.0, 0.0])
    batch["truncated"] = torch.tensor([False, False, True, False])
    assert GRPOLoss(TableLM(1)).rows(batch).moving.tolist() == [False, True, True, False]
    masked = GRPOLoss(TableLM(1), overlong="mask").rows(batch)
    assert masked.moving.tolist() == masked.signal.tolist() == [False, True, False, False]
    regularised = GRPOLoss(TableLM(1), overlong="mask", kl_to_ref_coeff=0.1).rows(batch)
    assert regularised.moving.tolist() == [True, True, False, True]
    assert regularised.signal.tolist() == [False, True, False, False]
    # the truncated row's tokens leave the loss mask, and with them its weight (sequence_mean: one per row)
    assert masked.weight() == 3.0 and masked.weight(torch.tensor([1, 2])) == 1.0


def test_micro_batches_are_cut_from_rows_sorted_by_length():
    attention = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    rows = torch.tensor([4, 0, 2, 1, 3])  # a shuffled window
    assert by_length(rows, attention).tolist() == [1, 3, 4, 0, 2]  # lengths 1, 2, 3, 3 (shuffled order kept), 4


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_an_optimizer_step_does_not_depend_on_how_its_rows_are_cut(aggregation):
    """One micro-batch of 4 rows, or 2 length-sorted micro-batches accumulated: the same update."""
    updated = []
    for micro_batch, accumulation in [(4, 1), (2, 2)]:
        policy, batch = TableLM(1), make_batch()
        settings = dataclasses.replace(SETTINGS, micro_batch=micro_batch, accumulation=accumulation)
        loss = GRPOLoss(policy, aggregation=aggregation, temperature=0.7)
        trainer = Trainer(policy, None, loss, torch.optim.SGD(policy.parameters(), lr=1.0), settings,
                          torch.device("cpu"), None)
        trainer.prepare(batch)
        trainer.optimize(batch)
        updated.append(policy.table.detach())
    assert not torch.equal(updated[0], TableLM(1).table.detach())
    torch.testing.assert_close(updated[0], updated[1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_a_single_update_takes_its_old_log_probs_from_the_training_forward(aggregation, monkeypatch):
    """One epoch, one optimizer step: no forward of its own for the old log-probs (the batch carries none), the
    update the recomputed ones give (to float rounding), a ratio of exactly 1 and the same engine gap."""
    runs = {}
    for own in (True, False):
        policy, batch = TableLM(1), make_batch()
        batch["reward"] = torch.tensor([1.0, 0.0, 0.5, 0.25])  # no tie: every row trains, the gap is over all
        settings = dataclasses.replace(SETTINGS, micro_batch=2, accumulation=2, kl_in_reward_coeff=0.0)
        trainer = Trainer(policy, None, GRPOLoss(policy, aggregation=aggregation, temperature=0.7),
                          torch.optim.SGD(policy.parameters(), lr=1.0), settings, torch.device("cpu"), None)
        if not own:
            monkeypatch.setattr(trainer, "single_update", lambda rows: False)
        metrics = trainer.prepare(batch)
        assert ("old_log_probs" in batch.keys()) is not own
        metrics.update(trainer.optimize(batch))
        runs[own] = policy.table.detach(), metrics
    (fast, fast_metrics), (slow, slow_metrics) = runs[True], runs[False]
    assert not torch.equal(fast, TableLM(1).table.detach())
    torch.testing.assert_close(fast, slow, atol=1e-6, rtol=0)
    assert fast_metrics["ratio_mean"] == fast_metrics["ratio_max"] == 1.0 and fast_metrics["clip_fraction"] == 0.0
    assert abs(slow_metrics["ratio_max"] - 1.0) < 1e-6
    assert fast_metrics["loss_objective"] == pytest.approx(slow_metrics["loss_objective"], abs=1e-6)
    mask = make_batch()["completion_mask"]
    gap = (by_hand(TableLM(1), make_batch()["tokens"], mask, 0.7) - make_batch()["sample_log_probs"]).abs()[mask].max()
    assert fast_metrics["engine_trainer_logp_gap_max"] == pytest.approx(gap.item(), abs=1e-6)
    assert slow_metrics["engine_trainer_logp_gap_max"] == pytest.approx(gap.item(), abs=1e-6)


def test_several_updates_a_step_recompute_the_old_log_probs_first():
    for settings in (dataclasses.replace(SETTINGS, micro_batch=2, accumulation=1),  # two optimizer steps
                     dataclasses.replace(SETTINGS, micro_batch=4, accumulation=1, epochs=2)):  # two epochs
        policy, batch = TableLM(1), make_batch()
        Trainer(policy, None, GRPOLoss(policy), None, settings, torch.device("cpu"), None).prepare(batch)
        torch.testing.assert_close(batch["old_log_probs"],
                                   by_hand(policy, batch["tokens"], batch["completion_mask"], 0.7))


@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_adam_runs_torchs_fused_kernel_on_cpu_with_the_per_tensor_loops_update(name):
    """build_optimizer picks the fused kernel (on CPU torch would loop tensor by tensor): same update to float
    rounding."""
    from helpers import cfg_with
    from torchrl_grpo.run.build import build_optimizer

    cfg = cfg_with(f"optimizer.name={name}", "optimizer.lr=0.1", "optimizer.weight_decay=0.1")
    torch.manual_seed(0)
    fused_model, loop_model = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    loop_model.load_state_dict(fused_model.state_dict())
    initial = fused_model.weight.detach().clone()
    fused = build_optimizer(OptimizerSettings.from_config(cfg), fused_model)
    assert fused.param_groups[0]["fused"] is True
    cls = torch.optim.AdamW if name == "AdamW" else torch.optim.Adam
    loop = cls(loop_model.parameters(), lr=0.1, eps=cfg.optimizer.eps, weight_decay=0.1, foreach=False)
    for step in range(3):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
        for model, opt in ((fused_model, fused), (loop_model, loop)):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
    for a, b in zip(fused_model.parameters(), loop_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert (fused_model.weight - initial).abs().min() > 1e-3  # every weight took the three steps


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_the_learning_rate_follows_its_schedule_skips_with_an_update_and_resumes(schedule):
    """Each optimize call here is one optimizer step; 6 in the run, 2 of warmup from 0 (TRL's and the HF
    Trainer's formulas, computed by hand). A skipped update leaves the schedule where it was; a trainer built
    afresh from the state_dict goes on with the same rates."""
    import math
    from types import SimpleNamespace

    from helpers import cfg_with
    from torchrl_grpo.run.build import build_scheduler
    from torchrl_grpo.run.state import TrainerState

    def after_warmup(k):  # k: optimizer steps done, >= 2
        t = (k - 2) / 4
        return {"constant": 1.0, "linear": 1 - t, "cosine": 0.5 * (1 + math.cos(math.pi * t))}[schedule]

    expected = [0.1 * (k / 2 if k < 2 else after_warmup(k)) for k in range(6)]
    cfg = cfg_with(f"optimizer.scheduler={schedule}", "optimizer.warmup_steps=2")
    plan = SimpleNamespace(total_steps=3, optimizer_steps_per_step=2)
    settings = dataclasses.replace(SETTINGS, micro_batch=4)

    def trainer(policy, loss):
        optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
        return Trainer(policy, None, loss, optimizer, settings, torch.device("cpu"), None,
                       scheduler=build_scheduler(OptimizerSettings.from_config(cfg), optimizer, plan))

    policy = TableLM(1)
    loss = PoisonedLoss(policy)
    first = trainer(policy, loss)
    rates = []
    for k in range(3):
        loss.poisoned = k == 1
        metrics = first.optimize(make_batch())
        rates += [] if metrics["skipped_updates"] else [metrics["lr"]]
    resumed = trainer(policy, loss)
    TrainerState(resumed).load_state_dict(TrainerState(first).state_dict())
    rates += [resumed.optimize(make_batch())["lr"] for _ in range(4)]
    assert rates == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_the_update_counts_the_model_flops_of_each_micro_batch_three_times_when_it_has_a_backward():
    """One row per optimizer step: rows 0 and 1 (a group with signal, 4 and 3 tokens) train with a backward, rows 2
    and 3 (a tied group, 5 and 3 tokens) are still updates, a forward alone. A hand-made shape, N=10, L=2, H=3, Q=4:
    a row of T tokens costs 20 T + 96 T^2 forward."""
    from torchrl_grpo.models.flops import ModelShape

    policy = TableLM(1)
    trainer = Trainer(policy, None, GRPOLoss(policy, temperature=0.7), torch.optim.SGD(policy.parameters(), lr=0.1),
                      dataclasses.replace(SETTINGS, kl_in_reward_coeff=0.0), torch.device("cpu"), None)
    batch = make_batch()
    trainer.prepare(batch)
    assert trainer.model_shapes is None and "train_flops_per_s" not in trainer.optimize(batch.clone())  # no config
    trainer.model_shapes = [ModelShape(matmul_params=10, layers=2, heads=3, head_dim=4)]
    metrics = trainer.optimize(batch.clone())
    forward = {3: 20 * 3 + 96 * 9, 4: 20 * 4 + 96 * 16, 5: 20 * 5 + 96 * 25}  # 924, 1616, 2500
    expected = 3 * forward[4] + 3 * forward[3] + forward[5] + forward[3]
    assert metrics["still_updates"] == 2 and expected == 11044
    assert metrics["train_flops_per_s"] * metrics["train_time"] == pytest.approx(expected, rel=1e-9)
    assert "mfu" not in metrics  # no peak known (the CPU)
    trainer.peak_flops = 1e6
    metrics = trainer.optimize(batch.clone())
    assert metrics["mfu"] == pytest.approx(metrics["train_flops_per_s"] / 1e6, rel=1e-12)


def test_mfu_divides_by_the_bf16_peak_of_every_training_gpu_when_the_trainer_computes_in_bf16(monkeypatch):
    """The CUDA branch with stand-ins: a tiny transformers model (on the CPU) whose trainer names cuda:0, a GPU
    called an H100 SXM; bf16 autocast, or bf16 weights, else no peak; a GPU not in the table, or the CPU, none."""
    from types import SimpleNamespace

    from transformers import Qwen2Config, Qwen2ForCausalLM

    names = {"cuda:0": "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: names[str(device)])
    cuda = torch.device("cuda:0")
    mixed = dataclasses.replace(SETTINGS, mixed_precision=True)

    def peak(policy, settings, device=cuda, parallel=None):
        return Trainer(policy, None, GRPOLoss(policy), None, settings, device, None, parallel).peak_flops

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    assert peak(model, mixed) == 989e12
    assert peak(model, mixed, parallel=SimpleNamespace(world_size=4)) == 4 * 989e12  # data-parallel: every rank's GPU
    assert peak(model, SETTINGS) is None  # float32 weights, no autocast
    assert peak(model, mixed, device=torch.device("cpu")) is None
    assert peak(model.to(torch.bfloat16), SETTINGS) == 989e12  # bf16 weights
    names["cuda:0"] = "NVIDIA GeForce RTX 4090"
    assert peak(model, mixed) is None
