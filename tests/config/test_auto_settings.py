"""The settings left to ``auto`` (torchrl_grpo/config/auto_settings.py): the choice against hand-made plans, against
the real plan where the engine's share of a GPU decides, and as ``torchrl-grpo plan`` and a run print it."""
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from helpers import FLOAT32, ROOT, SMALL, cfg_with, metric_rows, run
from torchrl_grpo.config.auto_settings import (
    GPU_BUDGET,
    Settings,
    budgets,
    candidates,
    choose,
    packed_budgets,
    planned_with,
    whole_chunk_mib,
)
from torchrl_grpo.config.memory_plan import Device, GiB, Item, Role
from torchrl_grpo.config.spec import resolve_run
from torchrl_grpo.core.checkpoint import Key, load_state
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.run.memory import model_shape, run_memory_plan, settle_auto

AUTO = ["train_model.gradient_checkpointing=auto", "train.micro_batch_tokens=auto"]
# a GPU run's batch: 8 completions an optimizer step (4 a micro-batch, 2 micro-batches), rows of up to 1024 tokens
TOKEN = 1 / 1024  # GiB a packed token holds in the hand-made plans
VOCAB = 1000
GPU_BATCH = ["env.num_envs=2", "env.repeats=4", "train.optim_batch_size=4", "inference_model.max_model_len=1024"]


def gpu_spec(*overrides):
    return resolve_run(cfg_with(*GPU_BATCH, *overrides), gpu_count=1)


def hand_made_plan(base_gib: float, activations_gib: float, per_token_gib: float, capacity_gib: float = 80):
    """A device whose trainer holds ``base_gib``, ``activations_gib`` more without checkpointing, and
    ``per_token_gib`` a packed token (4 rows of 1024 when padded)."""
    def plan_of(spec):
        tokens = spec.plan.micro_batch_tokens or 4 * 1024
        held = base_gib + (0 if spec.model.gradient_checkpointing else activations_gib) + tokens * per_token_gib
        role = Role("trainer", "cuda:0", (Item("all", int(held * GiB)),))
        return [Device("cuda:0", int(capacity_gib * GiB), [role])]
    return plan_of


def test_candidates_come_fastest_first_and_an_explicit_key_is_kept():
    spec = gpu_spec(*AUTO)
    assert spec.auto == ("train_model.gradient_checkpointing", "train.micro_batch_tokens")
    assert spec.model.gradient_checkpointing and spec.plan.micro_batch_tokens is None  # memory-lean until chosen
    assert packed_budgets(spec) == [8192, 4096, 2048, 1024]  # the optimizer step's 8 rows, halving to one row
    assert candidates(spec, VOCAB) == [*(Settings(False, b) for b in (8192, 4096, 2048, 1024)),
                                *(Settings(True, b) for b in (8192, 4096, 2048, 1024))]
    assert candidates(gpu_spec("train_model.gradient_checkpointing=true", "train.micro_batch_tokens=auto"),
                      VOCAB) == [Settings(True, b) for b in (8192, 4096, 2048, 1024)]
    assert candidates(gpu_spec("train_model.gradient_checkpointing=auto"), VOCAB) == [Settings(False, None),
                                                                                     Settings(True, None)]
    # on the CPU packing does not pay: padded rows only
    cpu = resolve_run(cfg_with(*GPU_BATCH, *AUTO))
    assert candidates(cpu, VOCAB) == [Settings(False, None), Settings(True, None)]
    # data-parallel ranks: a rank's share of the step, and at least two rows (each rank a share of every micro-batch)
    ranks = resolve_run(cfg_with(*GPU_BATCH, *AUTO, "train_model.num_devices=2", "train.strategy=fsdp"), gpu_count=2)
    assert ranks.placement.ranks == 2 and packed_budgets(ranks) == [4096, 2048]


def test_a_device_that_fits_everything_gets_checkpointing_off_and_the_largest_micro_batch():
    spec = gpu_spec(*AUTO)
    budget_of = budgets(0.5, 0)
    choice = choose(spec, hand_made_plan(10, 20, TOKEN), budget_of, VOCAB)  # 10 + 20 + 8 GiB of 72
    assert choice.fits and choice.settings == Settings(False, 8192)
    assert choice.budget == int(GPU_BUDGET * 80 * GiB) and choice.tightest.total == 38 * GiB
    assert choice.others["train_model.gradient_checkpointing"][1].total == 18 * GiB  # on: 10 + 8
    assert choice.others["train.micro_batch_tokens"][1].total == 34 * GiB  # padded: 4 rows of 1024
    assert choice.overrides() == {"train_model.gradient_checkpointing": False, "train.micro_batch_tokens": 8192}
    assert choice.line() == ("auto: gradient checkpointing off, packed micro-batches of 8192 tokens (cuda:0 38.0 of "
                             "its 72.0 GiB budget; gradient checkpointing on: 18.0 GiB; padded micro-batches: 34.0 "
                             "GiB)")


def test_a_device_that_fits_only_with_checkpointing_gets_it_with_the_largest_micro_batch_that_fits():
    spec = gpu_spec(*AUTO)
    # off: 30 + 10 + 1 = 41 GiB at the least, over the 36 GiB budget; on: 30 + 8 = 38 at 8192, 30 + 4 = 34 at 4096
    choice = choose(spec, hand_made_plan(30, 10, TOKEN, capacity_gib=40), budgets(0.5, 0), VOCAB)
    assert choice.fits and choice.settings == Settings(True, 4096)
    assert choice.tightest.total <= choice.budget == int(0.9 * 40 * GiB)
    assert choice.others["train_model.gradient_checkpointing"][1].total > choice.budget


def test_where_nothing_fits_the_leanest_is_kept_and_the_check_refuses_in_one_line(tmp_path):
    spec = gpu_spec(*AUTO)
    choice = choose(spec, hand_made_plan(60, 10, TOKEN, capacity_gib=40), budgets(0.5, 0), VOCAB)
    assert not choice.fits and choice.settings == Settings(True, 1024)
    assert choice.line().startswith("auto: nothing fits the budget, the leanest kept: gradient checkpointing on, "
                                    "packed micro-batches of 1024 tokens (cuda:0 61.0 of its 36.0 GiB budget")
    # as users see it: the plan of a 1.5B model on a 16 GiB GPU
    done = subprocess.run([sys.executable, "-m", "torchrl_grpo", "plan", "model.name=Qwen/Qwen2.5-1.5B-Instruct",
                           *AUTO, "--gpus", "1", "--device-memory", "16"], cwd=tmp_path, capture_output=True,
                          text=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1, done.stderr[-2000:]
    assert "settings left to auto: nothing fits the budget (cuda:0's budget 14.4 GiB" in done.stdout
    assert "  train_model.gradient_checkpointing=true  gradient checkpointing on; gradient checkpointing off: " \
        in done.stdout
    assert "does not fit" in done.stdout


@pytest.mark.parametrize("share, chosen", [(0.2, Settings(False, 4096)), (0.55, Settings(True, 4096))])
def test_the_engines_share_of_a_shared_gpu_decides(share, chosen):
    """Qwen2.5-0.5B trained in full beside its engine, awake, on a 24 GiB GPU (the real plan: the trainer holds 8.93
    GiB with checkpointing off at the least micro-batch, 13.64 at 4096 tokens; 8.20 with it on at 4096): an engine
    that takes a fifth leaves room for every layer's activations; one that takes 55% does not."""
    spec = gpu_spec(*AUTO, "model.name=Qwen/Qwen2.5-0.5B-Instruct", "inference_model.sleep=0",
                    f"inference_model.gpu_memory_utilization={share}")
    shape = model_shape(spec)
    choice = choose(spec, lambda s: run_memory_plan(s, device_gib=24, shape=shape)[0], budgets(0.5, 0), shape.vocab)
    assert choice.fits and choice.settings == chosen
    [device] = run_memory_plan(spec, device_gib=24, shape=shape)[0]
    engine = next(r for r in device.roles if r.name == "engine")
    assert engine.bytes == pytest.approx(share * 24 * GiB, rel=1e-6) and not engine.released  # awake: it counts
    if chosen.gradient_checkpointing:  # off would not fit beside the engine
        assert choice.others["train_model.gradient_checkpointing"][1].total > choice.budget


CHUNK = "train.log_prob_chunk_mib=auto"
ENGINE = ["inference_model.gpu_memory_utilization=auto"]  # with inference_model.sleep=auto, the default


def test_the_log_prob_chunk_holds_a_whole_micro_batch_where_that_fits_and_counts_least():
    spec = gpu_spec(*AUTO, CHUNK)
    vocab = 2 ** 18  # a MiB of float32 logits holds one token
    # padded: 4 rows of 24 completion tokens; packed: an optimizer step's 8 completions at most, and the budget
    assert whole_chunk_mib(spec, None, vocab) == 4 * 24
    assert whole_chunk_mib(spec, 8192, vocab) == 8 * 24 and whole_chunk_mib(spec, 128, vocab) == 128
    assert candidates(spec, vocab)[:4] == [Settings(False, 8192, 8 * 24), Settings(False, 8192, None),
                                           Settings(False, 4096, 8 * 24), Settings(False, 4096, None)]
    plain = hand_made_plan(10, 20, TOKEN, capacity_gib=40)  # 10 + 20 + 8 GiB at 8192 tokens

    def plan_of(s):  # a whole micro-batch's logits: 4 live copies of its chunk
        [device] = plain(s)
        whole = Role("logits", "cuda:0", (Item("whole", 4 * (s.plan.log_prob_chunk_mib or 0) << 20),))
        return [Device(device.name, device.capacity, [*device.roles, whole])]

    # 38 GiB and the whole logits' 0.75 more over a 38.5 GiB budget: the device's chunk before a smaller micro-batch
    assert choose(spec, plan_of, lambda d: int(38.5 * GiB), vocab).settings == Settings(False, 8192, None)
    roomy = choose(spec, plan_of, lambda d: 40 * GiB, vocab)
    assert roomy.settings == Settings(False, 8192, 192) and roomy.fits
    assert "log-prob chunks of 192 MiB (a micro-batch's logits at once)" in roomy.line()
    assert roomy.others["train.log_prob_chunk_mib"][0] == Settings(False, 8192, None)
    # on a CPU chunks cost nothing: the device's, no other tried
    assert candidates(resolve_run(cfg_with(*GPU_BATCH, *AUTO, CHUNK)), vocab) == [Settings(False, None),
                                                                                 Settings(True, None)]
    explicit = gpu_spec("train.log_prob_chunk_mib=3")
    assert explicit.auto == () and explicit.train.log_prob_chunk_bytes == explicit.loss.log_prob_chunk_bytes == 3 << 20


def test_the_engine_takes_what_the_budget_leaves_awake_where_that_fits_else_asleep():
    """The real plan: Qwen2.5-1.5B trained in full beside its engine on a 40 GiB GPU fits with the engine awake;
    Qwen2.5-0.5B on a 24 GiB one takes checkpointing off and the largest micro-batch only with the engine asleep
    while it trains. Either way the engine's share is the largest that fits (a hundredth more does not), and it holds
    a step's sequences."""
    for model, gib, sleep in [("Qwen/Qwen2.5-1.5B-Instruct", 40, 0), ("Qwen/Qwen2.5-0.5B-Instruct", 24, 2)]:
        spec = gpu_spec(*AUTO, CHUNK, *ENGINE, f"model.name={model}")
        assert spec.auto[-2:] == ("inference_model.gpu_memory_utilization", "inference_model.sleep")
        assert spec.engine.sleep == 2 and spec.engine.gpu_memory_utilization == 0.5  # the rule's, until chosen
        shape = model_shape(spec)

        def plan_of(s):
            return run_memory_plan(s, device_gib=gib, shape=shape)[0]

        choice = choose(spec, plan_of, budgets(0.5, 0), shape.vocab)
        chosen = choice.settings
        assert choice.fits and chosen.sleep == sleep and not chosen.gradient_checkpointing, choice.line()
        [device] = plan_of(planned_with(spec, chosen))
        engine = next(r for r in device.roles if r.name == "engine")
        assert device.total <= 0.9 * gib * GiB and engine.bytes >= engine.wants > 0
        assert engine.bytes == pytest.approx(chosen.gpu_memory_utilization * gib * GiB, rel=1e-6)
        more = Settings(**{**chosen.__dict__, "gpu_memory_utilization": chosen.gpu_memory_utilization + 0.01})
        assert plan_of(planned_with(spec, more))[0].total > 0.9 * gib * GiB
        assert choice.overrides()["inference_model.sleep"] == sleep
    # the engine on a GPU of its own: the whole budget, awake
    apart = resolve_run(cfg_with(*GPU_BATCH, *ENGINE, "model.name=Qwen/Qwen2.5-0.5B-Instruct"), gpu_count=2)
    assert apart.placement.inference == ["cuda:1"] and apart.engine.sleep == 0
    shape = model_shape(apart)
    choice = choose(apart, lambda s: run_memory_plan(s, device_gib=24, shape=shape)[0], budgets(0.5, 0), shape.vocab)
    assert choice.settings.gpu_memory_utilization == GPU_BUDGET and choice.settings.sleep == 0


def test_an_engine_that_cannot_hold_a_step_beside_the_trainer_is_planned_at_its_need_and_refused():
    spec = gpu_spec(*AUTO, *ENGINE, "model.name=Qwen/Qwen2.5-1.5B-Instruct")
    shape = model_shape(spec)

    def plan_of(s):
        return run_memory_plan(s, device_gib=24, shape=shape)[0]

    choice = choose(spec, plan_of, budgets(0.5, 0), shape.vocab)
    assert not choice.fits and choice.settings.gradient_checkpointing and choice.settings.sleep == 2
    [device] = plan_of(planned_with(spec, choice.settings))
    engine = next(r for r in device.roles if r.name == "engine")
    less = Settings(**{**choice.settings.__dict__,
                       "gpu_memory_utilization": choice.settings.gpu_memory_utilization - 0.01})
    assert engine.bytes >= engine.wants > next(r for r in plan_of(planned_with(spec, less))[0].roles
                                               if r.name == "engine").bytes  # the least that holds a step
    assert device.total > 0.9 * 24 * GiB and choice.line().startswith("auto: nothing fits the budget")


def test_a_cpu_budget_is_a_share_of_the_free_memory():
    budget_of = budgets(0.25, 8 * GiB)
    assert budget_of(Device("cpu", 64 * GiB)) == 2 * GiB
    assert budget_of(Device("cuda:0", 80 * GiB)) == int(0.9 * 80 * GiB)
    assert budget_of(Device("cuda:0", None)) is None
    spec = resolve_run(cfg_with(*AUTO, "model=tiny"))
    plan_of = hand_made_plan(0.4, 0.5, 0)  # 0.9 GiB with checkpointing off, 0.4 with it on

    def cpu_plan(s):
        return [Device("cpu", 64 * GiB, plan_of(s)[0].roles)]

    assert choose(spec, cpu_plan, budgets(0.25, 8 * GiB), VOCAB).settings == Settings(False, None)  # within 2 GiB
    assert choose(spec, cpu_plan, budgets(0.25, 2 * GiB), VOCAB).settings == Settings(True, None)  # 0.9 > 0.5 GiB


def test_auto_is_a_value_of_its_keys_only():
    for override, message in [("train_model.gradient_checkpointing=maybe", "must be auto, true or false"),
                              ("train.micro_batch_tokens=lots", "must be auto or a positive integer"),
                              ("train.auto_cpu_memory_share=0", "must be in (0, 1]")]:
        with pytest.raises(ConfigError) as refused:
            resolve_run(cfg_with(override))
        key, value = override.split("=")
        assert str(refused.value) in (f"{key}={value!r}: {message}", f"{key}={int(value) if value.isdigit() else value}"
                                                                     f": {message}"), str(refused.value)


def test_settling_writes_the_choice_into_the_config_and_the_spec():
    cfg = cfg_with(*AUTO, "model=tiny")
    spec, choice = settle_auto(cfg, resolve_run(cfg))
    assert choice is not None and spec.auto == () and spec.auto_chosen == choice.line()
    assert OmegaConf.select(cfg, "train_model.gradient_checkpointing") is choice.settings.gradient_checkpointing
    assert spec.config["train"]["micro_batch_tokens"] is None  # a CPU: padded
    every = cfg_with(*AUTO, CHUNK, *ENGINE, "model=tiny")
    spec, choice = settle_auto(every, resolve_run(every))  # a CPU: the device's chunk; no engine on a GPU to share
    assert spec.auto == () and spec.plan.log_prob_chunk_mib is None and spec.engine.sleep == 0
    assert OmegaConf.select(every, "inference_model.gpu_memory_utilization") == 0.5
    assert "the device's log-prob chunk, no vLLM engine on a GPU to share, the engine awake while training" in \
        choice.line()
    unchanged = cfg_with("model=tiny")
    assert settle_auto(unchanged, resolve_run(unchanged)) == (resolve_run(unchanged), None)


def test_a_run_with_auto_says_what_it_chose_and_its_peak_stays_within_the_plan(tmp_path):
    """The tiny model on this CPU: the start-up line names the choice, the run trains with it (its saved config
    says so), and its measured peak resident set stays within the plan's total for it (10%: the plan's accuracy)
    and the budget."""
    run_dir = tmp_path / "run"
    done = run([*SMALL, *FLOAT32, *AUTO, CHUNK, *ENGINE, "train.total_dialog_turns=16",
                "logging.checkpoint_frequency=2", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [x for x in done.stdout.splitlines() if x.startswith("auto: ")]
    assert line.startswith("auto: gradient checkpointing off, padded micro-batches, the device's log-prob chunk, no "
                           "vLLM engine on a GPU to share, the engine awake while training (cpu ") and \
        "packing does not pay on a CPU" in line, line
    planned = float(line.split("(cpu ")[1].split(" of its ")[0])
    budget = float(line.split(" of its ")[1].split(" GiB budget")[0])
    saved = OmegaConf.load(run_dir / ".hydra" / "config.yaml")  # Hydra's record of what was asked: auto
    assert saved.train_model.gradient_checkpointing == "auto"
    recorded = load_state(run_dir / "checkpoints" / "step_000002")[Key.CONFIG]  # what the run trained with
    assert recorded["train_model"]["gradient_checkpointing"] is False
    peak = max(float(r["memory/peak_rss_gib"]) for r in metric_rows(run_dir))
    assert peak <= planned * 1.1 and planned <= budget, (peak, planned, budget)
