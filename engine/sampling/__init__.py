"""How tokens are picked: ``SamplingParams``, the batched sampler, counter-based random numbers."""
