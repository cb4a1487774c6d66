"""Reward functions for GRPO: one registry of plain functions, with a "module:function" escape hatch."""
