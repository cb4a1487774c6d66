"""The live A/B gateway (`hermes-lab serve`): its arms, log, experiment, report, and rounds on live traffic."""
