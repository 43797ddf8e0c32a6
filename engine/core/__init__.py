"""The serving loop: a request's state, the scheduler, ``LLMEngine.step()``, its outputs, and the asyncio bridge."""
