"""Speculative decoding: proposers (n-gram prompt lookup, a draft model), verification by
rejection sampling, and the policy that decides how many tokens each request speculates."""
