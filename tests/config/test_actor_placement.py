"""Where grpo-async.py's rollout actors run on a machine with GPUs, decided before any model loads: which GPUs a
local Ray may hand them and which the trainer keeps, each engine's memory share, GPUs hidden from CPU actors, and the
memory plan's rows for them."""
import os

import pytest

from helpers import cfg_with
from torchrl_grpo.collect.rollout_actors import actor_options, ray_init_kwargs, ray_sees_gpus
from torchrl_grpo.config.memory_plan import Engine, ModelShape, micro_batch, plan_memory
from torchrl_grpo.config.spec import resolve_run
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.core.gpus import physical_ids


def actors_on(gpus: int, *overrides):
    spec = resolve_run(cfg_with("mode=async", *overrides), gpu_count=gpus)
    return spec, spec.placement.actors


def test_actors_take_the_gpus_free_of_training_and_never_the_trainers():
    spec, actors = actors_on(4, "ray.num_actors=3", "ray.actor_num_gpus=1")
    assert spec.placement.train == ["cuda:0"]
    assert actors.ray_gpus == (1, 2, 3) and not actors.shares_training
    assert actors.engines == (("cuda:1",), ("cuda:2",), ("cuda:3",))
    # a reference on a GPU of its own is training's too
    _, actors = actors_on(4, "ray.num_actors=2", "ray.actor_num_gpus=1", "train.kl_to_ref_coeff=0.1",
                          "ref_model.devices=[1]")
    assert actors.ray_gpus == (2, 3)
    # shares pack onto the free GPUs, two to a GPU at 0.5
    _, actors = actors_on(3, "ray.num_actors=3", "ray.actor_num_gpus=0.5")
    assert actors.ray_gpus == (1, 2) and actors.engines == (("cuda:1",), ("cuda:1",), ("cuda:2",))
    # tensor-parallel actors take runs of whole GPUs
    _, actors = actors_on(5, "ray.num_actors=2", "ray.actor_num_gpus=2")
    assert actors.engines == (("cuda:1", "cuda:2"), ("cuda:3", "cuda:4"))


def test_actors_that_do_not_fit_beside_training_share_its_gpu_or_are_refused():
    _, actors = actors_on(1, "ray.num_actors=2", "ray.actor_num_gpus=0.5")
    assert actors.ray_gpus == (0,) and actors.shares_training and actors.engines == (("cuda:0",), ("cuda:0",))
    with pytest.raises(ConfigError, match=r"^ray.num_actors=3 x ray.actor_num_gpus=0.5: the actors need 2 GPU\(s\) but "
                                          r"this machine has 1, 0 of them free of training; use fewer actors; a share "
                                          r"such as ray.actor_num_gpus=0.333 puts them all beside training$"):
        actors_on(1, "ray.num_actors=3", "ray.actor_num_gpus=0.5")
    with pytest.raises(ConfigError, match=r"^ray.num_actors=1 x ray.actor_num_gpus=2: the actors need 2 GPU\(s\)"):
        actors_on(2, "ray.actor_num_gpus=2")  # tensor parallel never shares the trainer's GPU
    with pytest.raises(ConfigError, match=r"^ray.actor_num_gpus=0.5 but this machine has no GPU for a local Ray"):
        actors_on(0, "ray.actor_num_gpus=0.5")


def test_auto_is_the_cpu_without_gpus_a_gpu_each_where_free_else_a_share_beside_training():
    assert actors_on(0)[1].per_actor == 0 and actors_on(0)[1].engines == (("cpu",),)
    assert actors_on(3, "ray.num_actors=2")[1].per_actor == 1
    _, actors = actors_on(1, "ray.num_actors=2")
    assert actors.per_actor == 0.5 and actors.shares_training
    _, actors = actors_on(2, "ray.num_actors=4")  # one GPU free for four actors: a quarter each, all on it
    assert actors.per_actor == 0.25 and actors.ray_gpus == (1,) and not actors.shares_training


def test_a_ray_cluster_places_its_actors_itself():
    _, actors = actors_on(0, "ray.address=auto", "ray.actor_num_gpus=1")
    assert actors.ray_gpus is None and actors.engines == (("cuda",),) and not actors.shares_training
    assert "num_gpus" not in ray_init_kwargs(resolve_run(cfg_with("mode=async", "ray.address=auto"),
                                                          gpu_count=0).actors)


def test_each_engine_takes_its_share_of_gpu_memory_utilization():
    for share, expected in (("0.5", 0.25), ("0.25", 0.125), ("1", 0.5), ("2", 0.5)):
        spec, _ = actors_on(5, "ray.actor_num_gpus=" + share, "inference_model.gpu_memory_utilization=0.5")
        assert spec.engine.gpu_memory_utilization == pytest.approx(expected), share
    sync = resolve_run(cfg_with("inference_model.gpu_memory_utilization=0.5"), gpu_count=1)
    assert sync.engine.gpu_memory_utilization == 0.5


def test_a_local_ray_is_shown_only_the_gpus_its_actors_may_take(monkeypatch):
    """The raylet reads CUDA_VISIBLE_DEVICES at start: the trainer's GPUs are left out of it, numbered as this
    process's own CUDA_VISIBLE_DEVICES maps them; the trainer's environment is as it was afterwards."""
    assert physical_ids((1, 2), {}) == "1,2"
    assert physical_ids((1, 2), {"CUDA_VISIBLE_DEVICES": "4, 5,6"}) == "5,6"
    assert physical_ids((), {"CUDA_VISIBLE_DEVICES": "4,5"}) == ""

    spec = resolve_run(cfg_with("mode=async", "ray.num_actors=2", "ray.actor_num_gpus=1"), gpu_count=3)
    assert ray_init_kwargs(spec.actors)["num_gpus"] == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4,5")
    with ray_sees_gpus(spec.actors):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,4,5"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    cpu = resolve_run(cfg_with("mode=async", "ray.actor_num_gpus=0"), gpu_count=2)
    with ray_sees_gpus(cpu.actors):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert ray_init_kwargs(cpu.actors)["num_gpus"] == 0


def test_an_actor_without_gpus_has_them_hidden():
    cpu = resolve_run(cfg_with("mode=async", "ray.actor_num_gpus=0"), gpu_count=2)
    assert actor_options(cpu.actors)["runtime_env"] == {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}
    gpu = resolve_run(cfg_with("mode=async", "ray.actor_num_gpus=1"), gpu_count=2)
    assert "runtime_env" not in actor_options(gpu.actors) and actor_options(gpu.actors)["num_gpus"] == 1


SHAPE = ModelShape(vocab=49152, hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, head_dim=64,  # SmolLM2
                   tied=True, qkv_bias=False, o_bias=False)
GIB = 1 << 30


def plan(spec, capacity=80 * GIB):
    capacities = {f"cuda:{i}": capacity for i in range(8)}
    return {d.name: d for d in plan_memory(SHAPE, spec, micro_batch(spec, 64), capacities, Engine(4096))}


def test_the_memory_plan_puts_each_actors_engine_on_its_gpu_with_its_share():
    spec, _ = actors_on(3, "ray.num_actors=2", "ray.actor_num_gpus=1", "inference_model.gpu_memory_utilization=0.5")
    devices = plan(spec)
    assert [r.name for r in devices["cuda:0"].roles] == ["trainer"]
    for i, gpu in enumerate(("cuda:1", "cuda:2")):
        (role,) = devices[gpu].roles
        assert role.name == f"rollout actor {i}'s engine" and role.bytes == 40 * GIB
    # two actors at half a GPU each beside the trainer: a quarter of it each, both counted on the trainer's GPU
    spec, _ = actors_on(1, "ray.num_actors=2", "ray.actor_num_gpus=0.5", "inference_model.gpu_memory_utilization=0.5")
    (only,) = plan(spec).values()
    engines = [r for r in only.roles if r.name.startswith("rollout actor")]
    assert len(engines) == 2 and all(r.bytes == 20 * GIB and not r.released for r in engines)
    trainer = next(r for r in only.roles if r.name == "trainer")
    assert only.total == trainer.bytes + 40 * GIB


def test_the_memory_plan_counts_a_process_per_cpu_actor():
    spec = resolve_run(cfg_with("mode=async", "ray.num_actors=2", "ray.actor_num_gpus=0"), gpu_count=0)
    devices = plan_memory(SHAPE, spec, micro_batch(spec, 64), {"cpu": 24 * GIB}, Engine(4096))
    (cpu,) = devices
    engines = [r for r in cpu.roles if r.name.startswith("rollout actor")]
    assert len(engines) == 2 and all(any(i.name == "its process" for i in r.items) for r in engines)
