"""Building blocks of the Llama family, written tensor-parallel-ready."""
