"""The round: the stage registry, the papermill runner, the flywheel, status, the round comparison, the live demo."""
