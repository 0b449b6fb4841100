"""The prefill worker: runs prompts, returns first tokens, ships KV to decode workers."""
