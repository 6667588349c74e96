"""Layer checkpoint: GGUF and HF files -> a built model (readers, conversion cache, devices, fit and placement, load)."""
