"""Shared services every layer may use: project paths, JSONL and atomic JSON, typed YAML, quiet output,
secret redaction, the flywheel state and clock, MLflow tracking. Imports nothing else of hermes_lab."""
