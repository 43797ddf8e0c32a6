"""The layers the models are built from: embedding, linear (dense and GGUF-quantized), rotary position embedding."""
