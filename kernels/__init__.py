"""Attention and fused ops. Every kernel has a torch reference in this package that it is
tested against; the references are also what runs on CPU."""
