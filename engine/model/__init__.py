"""The model half of the engine: weights, the Llama decoder and its layers, paged attention,
the KV cache, the CPU kernels, and the ``ModelRunner`` that runs one packed step."""
