"""Constrained decoding (structured outputs): a request's StructuredOutput compiled by
llguidance into a grammar, a per-request matcher that follows the sampled tokens, and the
per-step token bitmask the sampler applies."""
