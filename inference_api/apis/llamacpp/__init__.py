"""llama.cpp server's own API: POST /completion."""
