# Sourced by bench/gpu_learning_check.sh and bench/gpu_check.sh: the learning test's task (reward = share of digit
# characters, tests/training/test_learning.py) as grpo.py overrides, in LEARN. Steps and checkpoints are each caller's.
# Needs GSM8K_DATA (GSM8K rows as jsonl) and tests/ on PYTHONPATH (the reward).
LEARN=(model=tiny env=gsm8k "env.data_path=$GSM8K_DATA" env.num_envs=4 env.repeats=8
       train.optim_batch_size=16 train.gradient_accumulation_steps=1 inference_model.max_tokens=8 optimizer.lr=3e-3
       loss.aggregation=token_mean inference_model.temperature=1.0 logging.progress_bar=false
       "env.rewards=[{_target_:test_learning.digit_share,weight:1.0,name:digits}]")
