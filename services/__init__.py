"""splitserve's processes: gateway, prefill and decode workers (and their shared plumbing)."""
