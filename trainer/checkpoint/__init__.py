"""What a run leaves on disk: checkpoints (format, resume rules), the final model with its card, and the
upload to the Hugging Face Hub."""
