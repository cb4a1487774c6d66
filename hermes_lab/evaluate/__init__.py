"""Validate (stage 30): reward/KL inspection of a training run and the regression gate."""
