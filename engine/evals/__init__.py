"""Quality: perplexity, the A/B comparison and the layer sensitivity scan."""
