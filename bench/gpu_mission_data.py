"""The arithmetic task's questions (``env=arithmetic``, the README's first command) as GSM8K-format jsonl, for a machine
without reasoning-gym: ``env=gsm8k env.data_path=FOLDER`` then trains and evaluates on the same questions, with the
same system prompt and rewards. Not a test.

    python bench/gpu_mission_data.py FOLDER    # writes FOLDER/train.jsonl and FOLDER/test.jsonl
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omegaconf import OmegaConf  # noqa: E402

from torchrl_grpo.tasks.arithmetic import ArithmeticSettings, build_arithmetic_task  # noqa: E402


def main(folder: Path) -> None:
    env = OmegaConf.load(Path(__file__).resolve().parents[1] / "config" / "env" / "arithmetic.yaml")
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        task = build_arithmetic_task(ArithmeticSettings(tasks=OmegaConf.to_container(env.tasks), size=int(env.size),
                                                        seed=int(env.seed), split=split))
        with (folder / f"{split}.jsonl").open("w") as out:
            for row in task.rows:
                out.write(json.dumps({"question": row["question"], "answer": f"#### {row['answer']}"}) + "\n")
        print(f"{split}: {len(task.rows)} questions")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
