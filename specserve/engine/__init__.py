"""Engine core: request lifecycle, scheduling, KV cache and detokenization."""
