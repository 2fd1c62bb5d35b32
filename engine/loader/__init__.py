"""A model folder to a ready engine: weights, the memory plan and the load."""
