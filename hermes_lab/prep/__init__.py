"""Stage 10, prep (`python -m hermes_lab.prep`, `hermes-lab prep`): execution logs in, every line checked, deduped
and rewarded, GRPO and held-out prompt sets out (``hermes_lab.prep.run``)."""
