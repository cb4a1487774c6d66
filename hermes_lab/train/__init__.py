"""Train (stage 20): GRPO + LoRA with TRL's GRPOTrainer, checkpoints, resume and health.

python -m hermes_lab.train --config params/hermes_grpo_lora.yaml --data trajectories.jsonl --output out
"""
