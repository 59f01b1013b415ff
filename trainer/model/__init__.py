"""The only part that knows Hugging Face's T5: loading the model, swapping its modules for trainer.kernels,
the loss (packed rows included), LoRA, the model directory's files and shapes, and the tiny stand-in model."""
