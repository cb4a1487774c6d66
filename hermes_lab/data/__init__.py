"""Execute and distill (stages 00 and 10): the policy's execution logs in, GRPO prompt sets out."""
