"""The decode worker: continuous-batch generation over KV received from prefill workers."""
