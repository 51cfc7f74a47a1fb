"""``python -m torchrl_grpo`` is the ``torchrl-grpo`` command (torchrun takes it as ``-m torchrl_grpo``)."""
from torchrl_grpo.run.cli import main

if __name__ == "__main__":
    main()
