"""Training data: the Rust loader's Python side, the prompt template that travels with a model, generated
sample recipes and Hugging Face datasets."""
