"""Text in and out: tokenizer, chat templates, input validation, incremental detokenization, stop strings."""
