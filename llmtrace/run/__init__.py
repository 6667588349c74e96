"""Layer run: running a loaded model (the generation loop, the sampler, explain and lens)."""
