"""Speculative decoding: drafters, the acceptance rule and adaptive k."""
