"""What a model folder describes: the Llama-family transformer (one readable file), its
config, the attention seam and the tokenizer."""
