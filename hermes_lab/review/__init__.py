"""Human review (stage 15): the label store, the agreement gate and its statistics, the labelling widget."""
