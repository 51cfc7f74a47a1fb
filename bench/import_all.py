"""Import every torchrl_grpo module and print one Markdown line of the outcome, then one per failure (exit 1
if any). A module that needs vLLM is listed apart where vLLM is not installed (a GPU machine with torch and
transformers only). Not a test: bench/gpu_check.sh and bench/gpu_stack_check.sh run it on other stacks.

    python bench/import_all.py
"""
import importlib
import importlib.util
import pkgutil
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchrl_grpo  # noqa: E402


def main() -> int:
    has_vllm = importlib.util.find_spec("vllm") is not None
    ok, need_vllm, failed = [], [], []
    for info in pkgutil.walk_packages(torchrl_grpo.__path__, "torchrl_grpo."):
        try:
            importlib.import_module(info.name)
            ok.append(info.name)
        except ModuleNotFoundError as error:
            if error.name and error.name.split(".")[0] == "vllm" and not has_vllm:
                need_vllm.append(info.name)
            else:
                failed.append(f"{info.name} ({error})")
        except Exception as error:  # noqa: BLE001  (every failure is reported, with its traceback on stderr)
            failed.append(f"{info.name} ({type(error).__name__}: {error})")
            traceback.print_exc()
    print(f"{len(ok)} modules import; {len(need_vllm)} need vLLM, absent here: {', '.join(need_vllm) or '-'}")
    for line in failed:
        print(f"- FAILED {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
