"""Streaming generation (torchrl_grpo/engines/streaming.py) on the real vLLM CPU engine: a completion sampled across
a weight push carries both policy versions, and each token's log-prob is what the weights that sampled it give over
the KV cache the engine kept: the old weights' for the tokens before the push, the new weights' after it (computed
here with transformers, the cache of the tokens before the push the old model's)."""
import torch
from transformers import DynamicCache

from helpers import LOGPROB_TOL, needs_vllm, perturb
from torchrl_grpo.engines.streaming import StreamingEngine
from torchrl_grpo.models.loading import load_policy, merged_state_dict

pytestmark = needs_vllm


def _policy(path):
    return load_policy(path, dtype=torch.float32, device="cpu", trainable=False)


def kept_cache_log_probs(old, new, prompt: list[int], completion: list[int], before: int) -> torch.Tensor:
    """Each completion token's log-prob as the engine computed it: the first ``before`` tokens by ``old`` alone;
    the rest by ``new`` over a KV cache whose positions up to the last token sampled before the push ``old`` computed
    (that token's own entry comes from the first step after the push, under ``new``)."""
    ids = torch.tensor([prompt + completion])
    split = len(prompt) + before - 1  # positions [0, split) were cached before the push
    cache = DynamicCache()
    with torch.no_grad():
        first = old(ids[:, :split], past_key_values=cache, use_cache=True).logits
        rest = new(ids[:, split:-1], past_key_values=cache, use_cache=True).logits
    logits = torch.cat([first, rest], 1)[0, len(prompt) - 1:]
    return torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_a_completion_across_a_push_carries_both_versions_and_their_log_probs(vllm_engine, tiny_model_path,
                                                                              tokenizer):
    prompt = tokenizer("Ana has 5 apples and buys 3 more.")["input_ids"]
    stream = StreamingEngine(vllm_engine, max_tokens=14)
    stream.params["ignore_eos"] = True  # 14 tokens, whatever the tiny random model (640 tokens, eos among them) draws
    original, trainer = _policy(tiny_model_path), _policy(tiny_model_path)
    perturb(trainer, scale=0.2)
    try:
        stream.submit("a", prompt)
        assert stream.advance(max_steps=5) == [] and stream.in_flight == 1  # five steps in, still going
        with stream.pushing(1):
            vllm_engine.push_weights(merged_state_dict(trainer))
        [done] = stream.advance()
        while stream.in_flight:
            stream.advance()
    finally:
        stream.abort()
        vllm_engine.push_weights(merged_state_dict(original))
    assert done.key == "a" and len(done.token_ids) == 14, done
    before = done.versions.count(0)
    assert before >= 4 and done.versions == [0] * before + [1] * (14 - before)
    expected = kept_cache_log_probs(original, trainer, prompt, done.token_ids, before)
    got = torch.tensor(done.log_probs, dtype=torch.double)
    assert torch.allclose(got, expected, atol=LOGPROB_TOL, rtol=0), (got - expected).abs().max()
    # the test can tell: the old weights alone, or the new over a cache of their own, are far off after the push
    for wrong in (kept_cache_log_probs(original, original, prompt, done.token_ids, before),
                  kept_cache_log_probs(trainer, trainer, prompt, done.token_ids, 0)):
        assert (got[before:] - wrong[before:]).abs().max() > 100 * LOGPROB_TOL
