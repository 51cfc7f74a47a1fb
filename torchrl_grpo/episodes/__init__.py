"""Episodes, token in and token out: a task as a TorchRL environment, the turn environments (tools, retry
feedback, the sandbox), prompt order and the prompts that cannot fit, playing G episodes per prompt and packing
them into a TensorDict. Imports core and tasks; engines arrive as objects."""
