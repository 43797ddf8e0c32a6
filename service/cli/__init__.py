"""The ``nanoserve`` command line: the sub-commands, and the small blocking client they use."""
