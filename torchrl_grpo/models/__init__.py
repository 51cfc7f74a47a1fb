"""Model folders and models: where a ``model.name`` comes from (hub, local, packaged SmolLM2, tiny random,
LoRA adapters), loading the policy and tokenizer, the merged weights an engine takes, the LoRA adapter as an engine
loads it (and the reference it gives for free), FLOPs, attention over packed rows. Imports core, config and
parallel."""
