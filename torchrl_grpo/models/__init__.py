"""Model folders and models: where a ``model.name`` comes from (hub, local, packaged SmolLM2, tiny random,
LoRA adapters), loading the policy and tokenizer, the merged weights an engine takes. Imports core, config
and parallel."""
