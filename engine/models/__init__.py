"""Model implementations and the registry that maps `architectures` to them."""
