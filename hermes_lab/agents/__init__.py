"""Running an agent on tasks, graded by what it left behind: execute (stage 00) and the runners it and validate use.

``execute`` (the round's logs), ``play`` (a policy served on 127.0.0.1 for the real agent), ``hermes_loop`` (the
real Hermes Agent's own loop, many tasks in one sandboxed process; ``hermes_driver`` runs inside it), ``hermes_chat``
(one sandboxed ``hermes chat`` a task), ``standin`` (the stand-in agent: a client-side loop over the gateway's chat
API, ``hermes-lab agent``). The built-in in-process runner is ``hermes_lab.policy.episodes`` (the policy's build
plays it: it sits below this package); the tasks, their workspace and their verifiers are ``hermes_lab.tasks``'."""
