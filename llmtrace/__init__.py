"""llmtrace: watch a real LLaMA-family model turn a prompt into tokens, step by step."""

__version__ = "0.1.0"
