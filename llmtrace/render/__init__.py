"""Layer render: terminal views of events (generate/show, explain/lens, tokenize)."""
