"""Before anything loads: the predicted peak GPU memory of a config, named GPUs, and `trainer plan`'s
report."""
