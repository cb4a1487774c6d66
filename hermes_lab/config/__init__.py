"""The typed configuration: the user's hermes_grpo_lora.yaml plus the workbench's own sections, every check."""
