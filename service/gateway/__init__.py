"""``nanoserve gateway``: several replicas behind the smg gateway (the OpenAI API), as processes on one machine."""
