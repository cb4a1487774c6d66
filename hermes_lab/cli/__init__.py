"""`hermes-lab`: the command line on top of every stage, and `hermes-lab lab`."""
