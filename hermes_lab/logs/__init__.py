"""Agent logs as data: the canonical conversation record and one reader per format (stage: prep; the gateway's log
also in execute and the live rounds)."""
