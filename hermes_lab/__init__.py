"""hermes-lab: execute -> collect -> distill -> train (GRPO + LoRA) -> validate -> execute again."""

__version__ = "0.1.0"
