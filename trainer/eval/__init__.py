"""Using a trained model: evaluation during training, `trainer evaluate`, `trainer generate`, the recipe
metrics and `trainer serve`."""
