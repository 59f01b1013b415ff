"""Triton kernels and the autograd functions around them: T5 attention (plain and packed), the feed-forward,
norm and cross-entropy ops, grouped projections, Adafactor's grouped update, and their dropout RNG. torch and
Triton only: what plugs them into Hugging Face's T5 lives in trainer.model."""
