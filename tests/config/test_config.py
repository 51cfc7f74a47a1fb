"""Hydra composition of the real config tree, the batch arithmetic, placement and the prompt sampler."""
import re

import pytest

from helpers import cfg_with
from torchrl_grpo.config.placement import place, train_strategy
from torchrl_grpo.config.validate import batch_plan, validate
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.episodes.trajectories import PromptSampler


def test_default_config_composes_and_validates():
    cfg = cfg_with()
    plan = validate(cfg)
    assert cfg.model.name == "smollm2-135m-instruct" and cfg.env.dataset == "openai/gsm8k"
    assert cfg.mode == "sync" and cfg.loss.aggregation == "sequence_mean"
    assert plan.completions_per_step == 16 and plan.total_steps == 30


def test_groups_override_defaults_and_users_override_groups():
    cfg = cfg_with("model=qwen2.5-1.5b-instruct", "env=gsm_symbolic")
    assert cfg.model.name == "Qwen/Qwen2.5-1.5B-Instruct" and cfg.inference_model.max_tokens == 512
    assert cfg.env.dataset == "gsm_symbolic" and cfg.env.num_envs == 2
    cfg = cfg_with("model=qwen2.5-1.5b-instruct", "inference_model.max_tokens=64")
    assert cfg.inference_model.max_tokens == 64


def test_batch_arithmetic():
    cfg = cfg_with("env.num_envs=4", "env.repeats=6", "train.optim_batch_size=4",
                   "train.gradient_accumulation_steps=3", "train.epochs=2", "train.total_dialog_turns=100")
    plan = batch_plan(cfg)
    # 24 completions per step, 6 micro-batches of 4, 2 optimizer steps per epoch, 2 epochs
    assert (plan.completions_per_step, plan.micro_batches_per_epoch, plan.optimizer_steps_per_step) == (24, 6, 4)
    assert plan.total_steps == 5  # ceil(100 / 24)
    table = plan.table()
    assert "train.gradient_accumulation_steps" in table and "24" in table
    # null (the default): all of a step's micro-batches make one optimizer step, per epoch
    plan = batch_plan(cfg_with("env.num_envs=4", "env.repeats=6", "train.epochs=2", "train.total_dialog_turns=100"))
    assert (plan.micro_batch, plan.accumulation, plan.optimizer_steps_per_step) == (4, 6, 2)


def test_nucleus_sampling_is_accepted_with_recomputed_old_log_probs():
    validate(cfg_with("inference_model.top_p=0.9", "loss.old_log_probs=trainer"))


def test_placement_without_gpus_is_cpu_and_refuses_gpu_requests():
    assert place(cfg_with(), needs_ref=True, gpu_count=0).train == ["cpu"]
    with pytest.raises(ConfigError, match=r"^train_model.num_devices=2 .* no GPU: .* \(or train.strategy=fsdp"):
        place(cfg_with("train.strategy=layer_split", "train_model.num_devices=2"), needs_ref=False, gpu_count=0)
    with pytest.raises(ConfigError, match=r"^inference_model.devices=\[1\]"):
        place(cfg_with("inference_model.devices=[1]"), needs_ref=False, gpu_count=0)


def test_placement_with_gpus():
    three = place(cfg_with(), needs_ref=True, gpu_count=3)
    assert (three.train, three.inference, three.ref, three.shared) == (["cuda:0"], ["cuda:1"], ["cuda:2"], False)
    one = place(cfg_with(), needs_ref=True, gpu_count=1)
    assert one.train == one.inference == one.ref == ["cuda:0"] and one.shared
    split = ("train.strategy=layer_split", "train_model.num_devices=2", "inference_model.devices=[3]")
    two = place(cfg_with(*split), needs_ref=False, gpu_count=4)
    assert two.train == ["cuda:0", "cuda:1"] and two.inference == ["cuda:3"] and two.strategy == "layer_split"
    with pytest.raises(ConfigError, match=r"^train_model.num_devices=5 but this machine has 4 GPU"):
        place(cfg_with("train.strategy=layer_split", "train_model.num_devices=5"), needs_ref=False, gpu_count=4)
    with pytest.raises(ConfigError, match=r"^ref_model.devices=\[7\]: GPU\(s\) \[7\] do not exist"):
        place(cfg_with("ref_model.devices=[7]"), needs_ref=True, gpu_count=2)


def test_prompt_sampler_covers_each_epoch_and_resumes_exactly():
    sampler = PromptSampler(5, seed=3)
    first = sampler.take(5)
    assert sorted(first) == list(range(5))
    second = sampler.take(2)
    state = sampler.state_dict()
    rest = sampler.take(7)
    assert sorted(second + rest[:3]) == list(range(5)) and len(set(rest[3:])) == 4  # pass 2 whole, 3 begun
    assert second + rest[:3] != first  # reshuffled at each pass
    again = PromptSampler(5, seed=3)
    again.load_state_dict(state)
    assert again.take(7) == rest
    assert PromptSampler(5, seed=4).take(5) != first or PromptSampler(5, seed=5).take(5) != first


def test_fsdp_ranks_must_divide_the_micro_batch():
    with pytest.raises(ConfigError, match=r"^train.strategy=fsdp \(fsdp\) with train_model.num_devices=3: .* do not "
                                          r"divide train.optim_batch_size=4; pick a multiple of 3"):
        validate(cfg_with("train.strategy=fsdp", "train_model.num_devices=3"))
    validate(cfg_with("train.strategy=fsdp", "train_model.num_devices=2"))
    validate(cfg_with("train.strategy=fsdp", "train_model.num_devices=2", "train.resume=auto"))  # resumes
    validate(cfg_with("train.strategy=fsdp", "train_model.num_devices=2", "mode=async"))  # grpo-async.py
    # the ranks sample the sharded policy together: async evaluation, the transformers engine
    validate(cfg_with("train.strategy=fsdp", "train_model.num_devices=2", "mode=async", "logging.eval_frequency=5"))
    validate(cfg_with("train.strategy=fsdp", "train_model.num_devices=2", "inference_model.backend=transformers"))
    validate(cfg_with("train.strategy=layer_split", "train_model.num_devices=3"))
    # auto: data-parallel ranks for several train devices (gloo without GPUs, nccl with), one process for one
    assert train_strategy(cfg_with("train_model.num_devices=2")) == "fsdp"  # gloo ranks on a CPU, nccl on GPUs
    assert train_strategy(cfg_with()) == "layer_split"  # one device: one process
    assert train_strategy(cfg_with("train_model.num_devices=2", "train_model.devices=[1,2]")) == "layer_split"
    assert place(cfg_with("train_model.num_devices=2"), needs_ref=True, gpu_count=0).train == ["cpu"]
    with pytest.raises(ConfigError, match=r"^train.strategy=auto \(fsdp\) with train_model.num_devices=3"):
        validate(cfg_with("train_model.num_devices=3"))


def test_fsdp_ranks_on_gpus_take_gpus_0_to_n_and_the_engine_the_next():
    """train.strategy=fsdp with GPUs: rank r trains on GPU r of its machine, the reference is sharded with the
    policy on the same GPUs, the engine takes the next free GPU (else shares GPU 0 with rank 0)."""
    fsdp = ("train.strategy=fsdp", "train_model.num_devices=2", "train.kl_to_ref_coeff=0.1")
    four = place(cfg_with(*fsdp), needs_ref=True, gpu_count=4)
    assert (four.train, four.ref, four.inference, four.shared) == (["cuda:0", "cuda:1"], ["cuda:0", "cuda:1"],
                                                                   ["cuda:2"], False)
    two = place(cfg_with(*fsdp), needs_ref=True, gpu_count=2)
    assert (two.train, two.inference, two.shared) == (["cuda:0", "cuda:1"], ["cuda:0"], True)
    with pytest.raises(ConfigError, match=r"^3 data-parallel ranks on this machine .* has 2 GPU\(s\)"):
        place(cfg_with("train.strategy=fsdp", "train_model.num_devices=3"), needs_ref=False, gpu_count=2)
    with pytest.raises(ConfigError, match=r"^train_model.devices=\[1, 2\] with train.strategy=fsdp: .*CUDA_VISIBLE"):
        place(cfg_with(*fsdp, "train_model.devices=[1,2]"), needs_ref=True, gpu_count=4)
    validate(cfg_with(*fsdp))  # no longer refused where GPUs are
    auto = place(cfg_with(*fsdp[1:]), needs_ref=True, gpu_count=4)  # what auto picks for several GPUs
    assert (auto.strategy, auto.ranks, auto.train, auto.inference) == ("fsdp", 2, ["cuda:0", "cuda:1"], ["cuda:2"])


def test_torchrun_ranks(monkeypatch):
    """Under torchrun (its variables set): auto is fsdp, train_model.num_devices takes its world size (another
    value is one line), and on GPUs each machine's ranks take its first GPUs: 4 ranks over 2 machines of 4."""
    from torchrl_grpo.config.placement import Launch, adopt_torchrun_ranks, torchrun_launch

    assert torchrun_launch({}) is None
    rendezvous = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert torchrun_launch({**rendezvous, "RANK": "0", "WORLD_SIZE": "1"}) is None  # one process
    assert torchrun_launch({**rendezvous, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}) == Launch(3, 4, 2)
    for key, value in {**rendezvous, "RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    cfg = cfg_with()
    assert train_strategy(cfg) == "fsdp"
    adopt_torchrun_ranks(cfg, torchrun_launch())
    assert cfg.train_model.num_devices == 4
    validate(cfg)
    placed = place(cfg, needs_ref=False, gpu_count=4)
    assert (placed.train, placed.inference) == (["cuda:0", "cuda:1"], ["cuda:2"])
    with pytest.raises(ConfigError, match=r"^train_model.num_devices=3 but torchrun started 4 ranks"):
        adopt_torchrun_ranks(cfg_with("train_model.num_devices=3"), torchrun_launch())
    with pytest.raises(ConfigError, match=r"^train.strategy=layer_split under torchrun \(4 ranks\)"):
        adopt_torchrun_ranks(cfg_with("train.strategy=layer_split"), torchrun_launch())


def test_an_actor_with_several_gpus_runs_a_tensor_parallel_engine(monkeypatch):
    """``ray.actor_num_gpus``: the CPU without GPUs; a share of one GPU or one; several whole GPUs, which Ray
    shows the actor as its first ones and vLLM shards the model over (tensor parallel); a fraction above 1 is
    one line."""
    import torch

    from torchrl_grpo.collect.rollout_actors import actor_devices
    from torchrl_grpo.config.spec import resolve_run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    def devices_for(gpus):
        return actor_devices(resolve_run(cfg_with("mode=async", f"ray.actor_num_gpus={gpus}"), gpu_count=5).actors)

    devices = {gpus: devices_for(gpus) for gpus in (0, 0.5, 1, 4)}
    assert devices == {0: ["cpu"], 0.5: ["cuda:0"], 1: ["cuda:0"], 4: ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]}
    validate(cfg_with("mode=async", "ray.actor_num_gpus=4"))
    with pytest.raises(ConfigError, match=r"^ray.actor_num_gpus=1.5: .* tensor parallel over whole GPUs; use 1 or 2$"):
        validate(cfg_with("mode=async", "ray.actor_num_gpus=1.5"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices_for(4) == ["cpu"]


def test_a_reference_placed_apart_under_fsdp_is_refused_not_dropped():
    """Each data-parallel rank holds its shard of the reference beside the policy's: a reference GPU asked for is
    refused in one line; without a KL to the reference the keys are moot."""
    from torchrl_grpo.config.spec import resolve_run

    base = ("train_model.num_devices=2", "train.kl_to_ref_coeff=0.1")
    spec = resolve_run(cfg_with(*base), gpu_count=4)
    assert spec.placement.strategy == "fsdp" and spec.placement.ref == spec.placement.train == ["cuda:0", "cuda:1"]
    for asked in ("ref_model.devices=[3]", "ref_model.num_devices=2"):
        with pytest.raises(ConfigError, match=rf"^{re.escape(asked)} with train.strategy=fsdp: each data-parallel rank "
                                              r"holds its shard of the reference"):
            resolve_run(cfg_with(*base, asked), gpu_count=4)
    resolve_run(cfg_with("train_model.num_devices=2", "ref_model.devices=[3]"), gpu_count=4)
