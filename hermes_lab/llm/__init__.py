"""Model APIs: the OpenAI-compatible client, its typed errors and diagnoses, the API judge, `hermes-lab doctor`."""
