"""Text Generation Inference's API (Hugging Face's server): /generate, /generate_stream, / and /info."""
