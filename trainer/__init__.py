"""Fine-tune FLAN-T5 on recipe dumps on one GPU, with a Rust data loader."""

__version__ = "0.1.0"
