"""The training run: the loop, one optimizer step, the run's state, optimizers, CUDA graphs and the DDP/FSDP
wrapping."""
