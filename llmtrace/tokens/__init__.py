"""Layer tokens: text <-> ids (tokenizer, vocabulary checks, BPE merge story, per-token facts, chat templates). No torch."""
