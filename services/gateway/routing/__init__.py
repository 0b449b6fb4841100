"""Routing: the worker pool (health, breakers, registry discovery), the scorers and prefix index
that pick a prefill and a decode worker, and the dispatcher that runs a request's RPCs on them."""
