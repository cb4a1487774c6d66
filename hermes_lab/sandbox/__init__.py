"""Running untrusted code: the executor interface, the local sandbox, the SandboxFusion client, test shapes.

Below the task suite and the rewards, above core: ``hermes_lab.tasks`` scores the embedded code family through
it, ``hermes_lab.rewards.tests`` is the tests reward on top of it.
"""
