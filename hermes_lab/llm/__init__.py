"""Model APIs: the OpenAI-compatible client, its typed errors and diagnoses, the API judge (`hermes-lab doctor`
checks the setup: hermes_lab.cli.doctor)."""
