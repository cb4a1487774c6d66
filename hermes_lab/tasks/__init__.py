"""The embedded task suite: seeded families with verifiers that play "system feedback" (offline, no hub)."""
