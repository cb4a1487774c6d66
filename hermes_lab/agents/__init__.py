"""Agent runners: an agent's own loop played on tasks, graded by what it left behind (the real Hermes Agent's)."""
