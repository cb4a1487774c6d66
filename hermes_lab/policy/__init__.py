"""The policy: load any causal LM or LoRA adapter, build the embedded tiny one, evaluate it; what a policy
argument names (hermes_lab.policy.arms)."""
