"""The config schema: one dataclass per section, one field per key, each with its type, range and meaning.

It is the single source of what a key may hold and what it means: :func:`check_schema` checks every field of the
composed config against it, once, before anything heavy starts, and fails in one line naming the key (exit code 2
through ``errors.exit_with_one_line``); docs/config-reference.md is written from it. The values of the defaults
live in ``config/*.yaml``, where users override them; ``tests/config/test_schema.py`` checks that the YAML and this
schema name the same keys. A mapping of fixed keys (``train_model.lora``, ``logging.wandb``) is a dataclass of its
own nested in its section (:func:`nested`), checked alike and named by its dotted key. Checks that involve several
keys (the batch arithmetic, combinations of loss variants) are :mod:`torchrl_grpo.config.validate`'s. ``env`` holds
the keys every task shares; each task's own are its settings class's, checked by
:func:`torchrl_grpo.tasks.check_env` when the run reads its inputs.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from omegaconf import DictConfig

from torchrl_grpo.core.errors import ConfigError
from torchrl_grpo.objective.advantages import REWARD_SCALES
from torchrl_grpo.objective.aggregation import AGGREGATIONS
from torchrl_grpo.objective.kl import KL_ESTIMATORS
from torchrl_grpo.objective.overlong import OVERLONG
from torchrl_grpo.objective.registry import MODIFIER_FLOORS, MODIFIER_HINTS
from torchrl_grpo.objective.surrogates import IMPORTANCE_LEVELS

ENGINE_PROCESSES = ("auto", "same", "own")  # inference_model.engine_process
WEIGHT_TRANSFERS = ("auto", "collective", "shm")  # inference_model.weight_transfer
LORA_SYNCS = ("auto", "adapter", "merged")  # train_model.lora.sync
SLEEP_LEVELS = ("auto", 0, 1, 2)  # inference_model.sleep
ADVANTAGES = ("group", "gae")  # loss.advantage

# kind -> (accepts(value), the default complaint)
_KINDS = {
    "int": (lambda v: _is_int(v), "must be an integer"),
    "int>0": (lambda v: _is_int(v) and v >= 1, "must be a positive integer"),
    "int>=0": (lambda v: _is_int(v) and v >= 0, "must be an integer >= 0"),
    "num>0": (lambda v: _is_num(v) and v > 0, "must be a number > 0"),
    "num>1": (lambda v: _is_num(v) and v > 1, "must be a number > 1"),
    "num>=0": (lambda v: _is_num(v) and v >= 0, "must be a number >= 0"),
    "auto|num>=0": (lambda v: v == "auto" or (_is_num(v) and v >= 0), "must be auto or a number >= 0"),
    "prob": (lambda v: _is_num(v) and 0 < v <= 1, "must be in (0, 1]"),
    "auto|prob": (lambda v: v == "auto" or (_is_num(v) and 0 < v <= 1), "must be auto or a number in (0, 1]"),
    "share": (lambda v: _is_num(v) and 0 <= v < 1, "must be in [0, 1)"),
    "unit": (lambda v: _is_num(v) and 0 <= v <= 1, "must be in [0, 1]"),
    "bool": (lambda v: isinstance(v, bool), "must be true or false"),
    "auto|bool": (lambda v: v == "auto" or isinstance(v, bool), "must be auto, true or false"),
    "auto|int>0": (lambda v: v == "auto" or (_is_int(v) and v >= 1), "must be auto or a positive integer"),
    "str": (lambda v: isinstance(v, str), "must be a string"),
    "names": (lambda v: isinstance(v, str) or (isinstance(v, Sequence) and all(isinstance(n, str) for n in v)),
              "must be a module name or a list of them"),
    "any": (lambda v: True, ""),
}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def key(kind: str, doc: str, *, choices: tuple[str, ...] = (), null: bool = False, hint: str | None = None):
    """A schema field: ``kind`` (see ``_KINDS``, or ``choice`` with ``choices``), its meaning, whether null is
    allowed, and the fix a bad value's error suggests (default: the kind's complaint)."""
    return field(metadata={"kind": kind, "doc": doc, "choices": choices, "null": null, "hint": hint})


def nested(schema: type):
    """A schema field holding a mapping whose keys are ``schema``'s fields (each made with :func:`key`)."""
    return field(metadata={"kind": "section", "schema": schema})


def check_value(name: str, value: Any, meta: dict) -> None:
    if value is None and meta["null"]:
        return
    if meta["kind"] == "choice":
        if value not in meta["choices"]:
            raise ConfigError(f"{name}={value!r}: {meta['hint'] or 'choose one of ' + ', '.join(meta['choices'])}")
        return
    require(name, value, meta["kind"], meta["hint"])


def require(name: str, value: Any, kind: str, hint: str | None = None) -> None:
    """``value`` of key ``name`` is of ``kind`` (see ``_KINDS``), else a one-line ConfigError with ``hint`` or
    the kind's complaint."""
    accepts, complaint = _KINDS[kind]
    if not accepts(value):
        raise ConfigError(f"{name}={value!r}: {hint or complaint}")


@dataclass
class Env:
    num_envs: int = key("int>0", "prompts per collection step")
    repeats: int = key("int>0", "completions per prompt: the group size G")
    max_steps: int = key("int>0", "engine turns per episode (single-turn tasks: 1; more need env.turn_env)")
    turn_env: Any = key("any", "what answers between turns: null (single-turn) | {_target_: a TurnEnv subclass, "
                        "its keyword arguments} (torchrl_grpo/episodes/turn_envs.py)", null=True)
    transforms: list = key("any", "TorchRL transforms on each episode's environment: [{_target_: a Transform class "
                           "or a function returning one, its keyword arguments}] (torchrl_grpo/episodes/task_env.py)")
    seed: int = key("int", "prompt order (shuffled each epoch of the dataset)")
    reward_errors: str = key("choice", "a reward function that raises: raise (stop the run, naming it and the "
                             "row) | zero (score 0, counted)", choices=("raise", "zero"))
    overlong_prompts: str = key("choice", "rows whose prompt + inference_model.max_tokens (x env.max_steps) exceeds "
                                "inference_model.max_model_len: drop (one warning line) | error (refuse the run)",
                                choices=("drop", "error"))
    reward_model: dict = key("any", "a sequence-classification reward model as a reward: {path, device (auto), "
                             "batch_size, max_length, torch_dtype, label, name, weight} (docs/tasks.md)", null=True)
    judge: dict = key("any", "an LLM judge on an OpenAI-compatible endpoint as a reward: {base_url, model, "
                      "template, score_pattern, scale, max_concurrency, timeout_s, max_retries, api_key_env, name, "
                      "weight} (docs/tasks.md)", null=True)
    chat_template_kwargs: dict = key("any", "keyword arguments of the tokenizer's chat template wherever a prompt or "
                                     "turn is rendered, e.g. {enable_thinking: false} for Qwen3")
    examples: list = key("any", "worked examples shown before every question (few-shot), as earlier turns: "
                         "[{role: user | assistant | tool, content: ...}], from a user turn to an assistant turn")


@dataclass
class Model:
    name: str = key("str", "tiny | smollm2-135m-instruct | a local HF-format dir or checkpoint | a hub id")
    compile: bool = key("bool", "torch.compile the training model")
    trust_remote_code: bool = key("bool", "let transformers and vLLM run the Python code a model folder ships "
                                  "(its config.json's auto_map); only for a model whose code you trust",
                                  hint="must be true or false (true runs the model folder's own code)")


@dataclass
class Train:
    exp_name: str = key("str", "the run's name (wandb)")
    seed: int = key("int", "global RNG and micro-batch shuffle")
    total_dialog_turns: int = key("int>0", "completions over the whole run; steps = total / completions per step")
    dialog_turns_per_batch: int = key("int>0", "completions per step; null = env.num_envs x env.repeats", null=True)
    optim_batch_size: int = key("int>0", "completions per forward/backward micro-batch")
    micro_batch_tokens: int | str = key("auto|int>0", "packed micro-batches: each optimizer step's completions end "
                                        "to end, no padding, at most this many tokens (prompts included) a "
                                        "micro-batch on each rank, instead of train.optim_batch_size completions; "
                                        "null = off; auto = chosen from the memory plan (docs/memory-plan.md)",
                                        null=True)
    log_prob_chunk_mib: int | str = key("auto|int>0", "MiB of float32 logits the log-probs' head computes at a "
                                        "time (each chunk recomputed in the backward): larger is faster on a GPU, "
                                        "smaller holds less; null = 64 on a CPU (where chunks cost nothing), 1/128 "
                                        "of a GPU's memory; auto = the whole micro-batch's where the memory plan "
                                        "fits it (docs/memory-plan.md)", null=True)
    gradient_accumulation_steps: int = key("int>0", "micro-batches per optimizer step; null = all of a step's",
                                           null=True)
    epochs: int = key("int>0", "passes over each collected batch (mu / num_iterations)")
    mixed_precision: bool | str = key("choice", "bf16 autocast over float32 master weights: auto (where bf16 is "
                                      "native: GPUs, CPUs with AVX-512 BF16 or AMX), true, false",
                                      choices=("auto", True, False),
                                      hint="choose auto (bf16 autocast where bf16 is native), true or false")
    max_nonfinite_updates: int = key("int>=0", "updates in a row skipped for a non-finite gradient that stop the "
                                     "run (with a checkpoint); 0 = never stop")
    no_signal_patience: int = key("int>=0", "steps in a row with no learning signal (every group tied, every "
                                  "token masked) or ess below train.min_ess before a warning naming the cause; "
                                  "0 = never")
    min_ess: float = key("share", "effective sample size (a share) of the importance weights below which a step "
                         "counts as collapsed")
    no_signal_stop: bool = key("bool", "stop with a checkpoint at the no-signal warning instead of going on")
    weight_sync_check: bool = key("bool", "after every weight push, compare the engine's and the trainer's "
                                  "log-probs of a probe text (torchrl_grpo/engines/weight_check.py)")
    weight_sync_tolerance: float = key("num>0", "mean |log-prob gap| the weight sync check allows; null = by the "
                                       "engine's and the trainer's dtypes, the larger of 0.005 float32, 0.02 float16, "
                                       "0.1 bfloat16", null=True)
    check_memory: bool = key("bool", "at the start, refuse a run whose memory plan (torchrl-grpo plan) cannot fit "
                             "a device even with the shortest prompts; false starts anyway")
    auto_cpu_memory_share: float = key("prob", "the settings left to auto keep a CPU's planned peak within this "
                                       "share of the memory free at the start (a GPU's: within 90% of its memory)")
    kl_coef_in_loss: bool = key("bool", "KL to the reference in the loss (true) or subtracted from the reward")
    kl_to_ref_coeff: float = key("num>=0", "0 skips the reference model entirely")
    kl_to_inference_coeff: float = key("num>=0", "KL to the sampling policy, in the loss")
    entropy_coeff: float = key("num>=0", "entropy bonus")
    resume: str = key("any", "null | auto (newest checkpoint of this run dir) | a checkpoint or run dir", null=True)
    sync_iter: bool = key("bool", "sync mode: false generates the next batch while this one trains")
    strategy: str = key("choice", "training over train_model.num_devices: layer_split (the layers split over the "
                        "GPUs) | fsdp (data-parallel ranks, FSDP2, started by grpo.py or torchrun; gloo on the CPU, "
                        "nccl on GPUs) | auto (fsdp for several train devices or under torchrun, else layer_split)",
                        choices=("auto", "fsdp", "layer_split"))
    rank_timeout_s: float = key("num>0", "fsdp: how long a rank waits for the others (the rendezvous, every "
                                "collective: the other ranks wait while rank 0 generates, evaluates and saves); past "
                                "it the run stops in one line", hint="must be a number of seconds > 0")


@dataclass
class Devices:
    num_devices: int = key("int>0", "GPUs for this role (ignored on a machine without GPUs)")
    devices: list = key("any", "explicit GPU ids, e.g. [0]; overrides num_devices", null=True)
    torch_dtype: str = key("str", "auto = bfloat16 on GPU, float32 on CPU", null=True)


@dataclass
class Lora:
    enabled: bool = key("bool", "train a LoRA adapter instead of every weight of the policy (docs/lora.md)")
    r: int = key("int>0", "the adapter's rank", hint="must be a positive integer (e.g. 8)")
    alpha: float = key("num>0", "the adapter's scale: its update times alpha / r",
                       hint="must be a positive number (e.g. 2*r)")
    dropout: float = key("share", "dropout on the adapter's input")
    target_modules: str | list = key("names", "the linear layers that get an adapter: all-linear | a module name | a "
                                     "list of them, e.g. [q_proj, v_proj]; null = all-linear", null=True)
    rslora: bool = key("bool", "rank-stabilised scaling: alpha / sqrt(r) instead of alpha / r",
                       hint="must be true or false (rank-stabilised scaling, alpha/sqrt(r))")
    modules_to_save: list = key("names", "whole modules trained beside the adapter, e.g. [lm_head]; pushes are then "
                                "merged", null=True)
    sync: str = key("choice", "what a push sends a vLLM engine: adapter (only the adapter's tensors) | merged (every "
                    "weight, the adapter merged in) | auto (the adapter to a vLLM engine on a GPU that can serve it, "
                    "else merged)", choices=LORA_SYNCS)


@dataclass
class TrainModel(Devices):
    torch_dtype: str = key("str", "the master weights: auto = float32 (the compute follows train.mixed_precision)",
                           null=True)
    gradient_checkpointing: bool | str = key("auto|bool", "recompute activations in the backward pass (memory); "
                                             "auto = off where the memory plan fits it (docs/memory-plan.md)")
    attn_implementation: str = key("str", "transformers' attention implementation (sdpa, eager, ...)")
    lora: Lora = nested(Lora)


@dataclass
class InferenceModel(Devices):
    torch_dtype: str = key("str", "the engine's weights: auto = bfloat16 on GPU; on the CPU bfloat16 when the trainer "
                           "computes in bf16 (train.mixed_precision), else float32", null=True)
    backend: str = key("choice", "rollout engine", choices=("vllm", "transformers"))
    gpu_memory_utilization: float | str = key("auto|prob", "share of its GPU vLLM may take; auto = what the memory "
                                              "plan leaves beside the trainer (with inference_model.sleep=auto, "
                                              "awake while training where that fits, docs/memory-plan.md)")
    temperature: float = key("num>0", "sampling temperature (the loss's log-probs use it too)")
    top_p: float = key("prob", "nucleus sampling")
    top_k: int = key("int>=0", "sample among the k most likely tokens; 0 = off")
    min_p: float = key("share", "drop tokens below min_p x the most likely token's probability; 0 = off")
    max_tokens: int = key("int>0", "completion tokens per sample")
    max_model_len: int = key("int>0", "prompt + completion tokens the engine accepts")
    engine_process: str = key("choice", "where vLLM's engine runs: same (this process), own (its own), auto "
                              "(same on CPU, own on a GPU)", choices=ENGINE_PROCESSES)
    weight_transfer: str = key("choice", "how weights reach an engine in another process: collective (vLLM's "
                               "weight-transfer API: NCCL on GPUs, gloo on CPUs; also to Ray rollout actors), shm (a "
                               "buffer in /dev/shm; Ray's object store for actors), auto (collective)",
                               choices=WEIGHT_TRANSFERS)
    sleep: int | str = key("choice", "vLLM's sleep mode while the trainer trains: 1 (KV cache released, weights moved "
                           "to the CPU), 2 (weights dropped too: the push replaces them), 0 (never); auto (2 where "
                           "the engine shares a GPU with the trainer or the reference and idles while they train, "
                           "else 0)", choices=SLEEP_LEVELS)
    max_engine_restarts: int = key("int>=0", "times grpo.py starts a new engine when its process dies (the current "
                                   "weights pushed and checked), then stops with a checkpoint")
    push_timeout_s: float = key("num>0", "a push to an engine in another process: how long its workers may take to "
                                "join the weight group and to take each bucket; past it the engine counts as "
                                "stalled", hint="must be a number of seconds > 0")
    start_timeout_s: float = key("num>0", "how long an engine in its own process may take to start (load, compile, "
                                 "CUDA graphs); past it its processes are killed and the run stops in one line",
                                 hint="must be a number of seconds > 0")
    generate_timeout_s: float = key("num>0", "how long an engine in its own process may take to answer a generate "
                                    "call; past it the engine is killed as stalled and replaced as a dead one is "
                                    "(inference_model.max_engine_restarts)", hint="must be a number of seconds > 0")


@dataclass
class Optimizer:
    name: str = key("choice", "optimizer", choices=("AdamW", "Adam", "SGD"))
    lr: float = key("num>0", "learning rate")
    eps: float = key("num>0", "Adam epsilon")
    clip_grad_norm: float = key("num>0", "max gradient norm", null=True,
                                hint="must be > 0, or null for no clipping")
    weight_decay: float = key("num>=0", "decoupled weight decay (AdamW), L2 otherwise")
    scheduler: str = key("choice", "learning-rate schedule over the run's optimizer steps, after the warmup: "
                         "constant, linear (to 0) or cosine (to 0), as transformers' get_scheduler",
                         choices=("constant", "linear", "cosine"))
    warmup_steps: int = key("int>=0", "optimizer steps of linear warmup from 0 to optimizer.lr")


@dataclass
class Wandb:
    enabled: bool = key("bool", "log each step to Weights & Biases")
    project: str = key("str", "the wandb project", null=True)
    mode: str = key("choice", "auto (online with a WANDB_API_KEY, offline otherwise) | online | offline | disabled",
                    choices=("auto", "online", "offline", "disabled"))


@dataclass
class Mlflow:
    enabled: bool = key("bool", "log each step to MLflow (the trackers extra)")
    tracking_uri: str = key("str", "the MLflow store; null = sqlite:///<run dir>/mlflow.db, a local one (mlflow ui "
                            "--backend-store-uri ...)", null=True)
    experiment: str = key("str", "the MLflow experiment; null = train.exp_name", null=True)


@dataclass
class Logging:
    experiment_name: str = key("any", "wandb run name (null: the run directory's)", null=True)
    checkpoint_dir: str = key("str", "relative to the run directory")
    checkpoint_frequency: int = key("int>=0", "steps between checkpoints (the last step always saves); 0 = at the end")
    keep_checkpoints: int = key("int>=0", "newest checkpoints kept; 0 = all")
    log_frequency: int = key("int>=0", "steps between console lines")
    eval_frequency: int = key("int>=0", "evaluate before the first step, every N steps and after the last; 0 = never")
    show_completions: int = key("int>=0", "sample completions printed per log line")
    progress_bar: bool = key("bool", "a progress bar with ETA on stderr, when stderr is a terminal")
    verbose: bool = key("bool", "library warnings and progress bars on the console too (always in grpo.log)")
    samples_frequency: int = key("int>=0", "steps between writes of the step's completions, their prompts, rewards "
                                 "and advantages to samples.jsonl (0: never)")
    wandb: Wandb = nested(Wandb)
    tensorboard: bool = key("bool", "TensorBoard event files in <run dir>/tensorboard (tensorboard --logdir outputs)")
    mlflow: Mlflow = nested(Mlflow)


@dataclass
class Eval:
    responses: str = key("str", "evaluate.py: score this JSONL ({dataset fields..., response} or {prompt, response}) "
                         "instead of generating", null=True,
                         hint="give the path of a JSONL file, or null to generate")
    num_prompts: int = key("int>0", "the first N prompts of the evaluation split; null = all", null=True)
    samples: int = key("int>0", "completions per prompt: pass@k for k = 1, 2, 4, ... up to it")
    temperature: float = key("num>=0", "0 = greedy", hint="must be a number >= 0 (0 = greedy)")
    max_tokens: int = key("int>0", "null = inference_model.max_tokens", null=True)


@dataclass
class Loss:
    """docs/objective.md gives each variant's equation; config/loss/*.yaml the presets. Besides these keys,
    each registered surrogate modifier (``objective/modifiers.py``: ``tis_cap``, ``off_policy_mask_threshold``, ...)
    is a key of its own, a number > 0 or null (off): see :func:`section_keys`."""

    clip_epsilon_low: float = key("num>=0", "ratio clipped below at 1 - eps_low (gmpo: log-ratio at -eps_low)")
    clip_epsilon_high: float = key("num>=0", "ratio clipped above at 1 + eps_high (clip-higher when > low; gmpo: "
                                   "log-ratio at eps_high)")
    tau_pos: float = key("num>0", "importance_level=sapo: the soft gate's temperature for positive advantages")
    tau_neg: float = key("num>0", "importance_level=sapo: the soft gate's temperature for the others")
    aggregation: str = key("choice", "how token losses become one number", choices=AGGREGATIONS)
    advantage: str = key("choice", "where the advantages come from: group (each prompt's completions, "
                         "loss.reward_scale) | gae (per token, from a critic's values: actor-critic PPO, critic.*)",
                         choices=ADVANTAGES)
    reward_scale: str = key("choice", "the advantages' baseline and scale", choices=REWARD_SCALES)
    kl_estimator: str = key("choice", "estimator of the KL terms", choices=KL_ESTIMATORS)
    old_log_probs: str = key("choice", "the ratio's denominator: engine, trainer, auto (trainer when it computes in "
                             "bf16)", choices=("auto", "engine", "trainer"))
    importance_level: str = key("choice", "the policy term: token ratio clipped, per completion (GSPO), cispo, sapo, "
                                "gmpo", choices=IMPORTANCE_LEVELS)
    overlong: str = key("choice", "truncated completions: kept, masked, or penalised in the reward", choices=OVERLONG)
    overlong_buffer: int = key("int>0", "soft overlong ramp in tokens; null = max_tokens // 5", null=True,
                               hint="must be a positive number of tokens, or null for inference_model.max_tokens // 5")
    dynamic_sampling: bool = key("bool", "DAPO: resample groups whose rewards all tie")
    max_resample_rounds: int = key("int>=0", "dynamic sampling: extra collection rounds per step at most")


@dataclass
class CriticModel:
    model: str = key("str", "the value model's starting weights with a fresh value head: null = model.name's | tiny "
                     "| smollm2-135m-instruct | a local HF-format dir | a hub id (loss.advantage=gae only)", null=True)
    lr: float = key("num>0", "the critic's learning rate (its optimizer otherwise optimizer.*'s)")
    value_clip: float = key("num>0", "the value loss's clip: V kept within V_old +- value_clip", null=True,
                            hint="must be a number > 0, or null for an unclipped value loss")
    gamma: float = key("unit", "discount per completion token")
    lmbda: float = key("unit", "GAE's lambda: 0 = one-step TD, 1 = Monte-Carlo returns minus the value")
    whiten_advantages: bool = key("bool", "normalise the advantages over the batch's loss tokens (mean 0, std 1)")


@dataclass
class Ray:
    address: str = key("any", "null: start a private local Ray | auto | host:port of a running cluster", null=True)
    num_actors: int = key("int>0", "rollout actors, each with its own engine, one collect in flight each")
    actor_num_cpus: float = key("num>=0", "Ray CPUs per actor (Ray sets the actor's OMP_NUM_THREADS to it)")
    actor_num_gpus: float | str = key("auto|num>=0", "Ray GPUs per actor: a share of one, or whole ones (tensor "
                                      "parallel); auto: 0 without GPUs, 1 where GPUs are free of training, else "
                                      "1/ray.num_actors beside training")
    collect_timeout_s: float = key("num>0", "no batch within this long (the first includes the actor's start-up): stop",
                                 hint="must be a number of seconds > 0")
    max_actor_restarts: int = key("int>=0", "times each actor that dies is replaced (with the current weights) "
                                  "before the run stops; 0 = stop at the first death")
    streaming: bool = key("bool", "each actor keeps env.num_envs groups in flight and hands them over as they "
                          "finish; a push lands between two decoding steps with the requests kept, and each token "
                          "records the policy version that sampled it (docs/usage.md#streaming)")
    init: dict = key("any", "extra ray.init keyword arguments for a local Ray (e.g. object_store_memory); its "
                     "num_cpus: null = ray.num_actors x ray.actor_num_cpus + 1 (the trainer), not every core")


@dataclass
class AsyncTrain:
    weight_update_frequency: int = key("int>0", "steps between weight pushes to the actors (each push bumps the "
                                       "policy version)")
    max_staleness: int = key("num>=0", "batches sampled more than this many versions ago are dropped (counted in "
                             "stale_dropped)")


SECTIONS: tuple[tuple[str, type], ...] = (
    ("env", Env), ("model", Model), ("train", Train), ("train_model", TrainModel), ("ref_model", Devices),
    ("inference_model", InferenceModel), ("optimizer", Optimizer), ("logging", Logging), ("eval", Eval),
    ("loss", Loss), ("critic", CriticModel),
)
ASYNC_SECTIONS: tuple[tuple[str, type], ...] = (("ray", Ray), ("train", AsyncTrain))  # config/mode/async.yaml
# the top-level key config/mode/*.yaml sets, which check_schema reads to know the sections
MODE = {"kind": "choice", "choices": ("sync", "async"), "null": False, "hint": None,
        "doc": "sync (grpo.py: collect, then train) | async (grpo-async.py and train(mode='async') add mode=async: Ray "
               "rollout actors collect while the trainer trains; the ray section and the async train keys)"}


def section_keys(section: str, schema: type) -> list[tuple[str, dict]]:
    """``(key, rule)`` of a section: its dataclass fields, and for ``loss`` the registered surrogate modifiers."""
    keys = [(f.name, dict(f.metadata)) for f in fields(schema)]
    if section == "loss":
        keys += [(name, {"kind": f"num>{MODIFIER_FLOORS[name]:g}", "choices": (), "null": True, "hint": hint,
                         "doc": "a surrogate modifier's parameter (docs/objective.md); null = off"})
                 for name, hint in MODIFIER_HINTS.items()]
    return keys


def leaf_keys(section: str, schema: type) -> list[tuple[str, dict]]:
    """``(dotted key, rule)`` of each key of a section that holds a value, a nested section's keys in its place."""
    keys = []
    for name, rule in section_keys(section, schema):
        dotted = f"{section}.{name}"
        keys += leaf_keys(dotted, rule["schema"]) if rule["kind"] == "section" else [(dotted, rule)]
    return keys


def check_schema(cfg: DictConfig) -> None:
    """Every schema key of ``cfg``: present, and of its kind and range."""
    sections = SECTIONS
    if cfg.get("mode") == "async":
        if cfg.get("ray") is None:
            raise ConfigError("mode=async needs the ray: block of config/mode/async.yaml; run grpo-async.py "
                              "(it adds mode=async)")
        sections += ASYNC_SECTIONS
    _no_unknown_keys(cfg, sections)
    for section, schema in sections:
        _check_keys(section, section_keys(section, schema), cfg.get(section), partial=False)


def check_nested(name: str, schema: type, node: Any, partial: bool = False) -> None:
    """A nested section (``train_model.lora``): a mapping of ``schema``'s keys and no other, each of its kind and
    range. ``partial``: a Python caller's mapping, whose missing keys take their defaults."""
    keys = section_keys(name, schema)
    if not isinstance(node, Mapping):
        raise ConfigError(f"{name}={node!r}: give a mapping of {', '.join(key for key, _ in keys)}")
    known = {key for key, _ in keys}
    for key in node:
        if key not in known:
            raise _unknown(f"{name}.{key}")
    _check_keys(name, keys, node, partial)


def _check_keys(prefix: str, keys: list[tuple[str, dict]], node: Any, partial: bool) -> None:
    for key, rule in keys:
        name = f"{prefix}.{key}"
        if node is None or key not in node:
            if partial:
                continue
            raise ConfigError(f"{name} is missing from the config: add it (docs/config-reference.md gives its "
                              "default)")
        if rule["kind"] == "section":
            check_nested(name, rule["schema"], node[key], partial)
        else:
            check_value(name, node[key], rule)


def _unknown(name: str) -> ConfigError:
    return ConfigError(f"{name}: unknown key; drop it (docs/config-reference.md lists every key)")


def _no_unknown_keys(cfg: DictConfig, sections: tuple[tuple[str, type], ...]) -> None:
    """A key the schema does not know (added with ``+key=...``) would be silently ignored: refuse it. ``env``'s
    are checked against its task (:func:`torchrl_grpo.tasks.check_env`), nested sections' with their keys."""
    known: dict[str, set[str]] = {"mode": set()}
    for section, schema in sections:
        known.setdefault(section, set()).update(name for name, _ in section_keys(section, schema))
    for section in cfg:
        if section not in known:
            raise ConfigError(f"{section}: unknown config section; known: {', '.join(known)}")
        node = cfg.get(section)
        if section in ("env", "mode") or not isinstance(node, DictConfig):
            continue
        for name in node:
            if name not in known[section]:
                raise _unknown(f"{section}.{name}")
