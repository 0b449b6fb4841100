"""The gateway's edge: the OpenAI HTTP+SSE API and the gRPC front door, request bodies turned into
GenerationSpecs (validation, limits, chat template, tokens) and worker tokens turned back into
text, stop strings, response bodies and SSE bytes."""
