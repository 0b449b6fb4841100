"""The gateway: OpenAI-compatible HTTP+SSE and a gRPC front door over prefill/decode workers."""
