"""Commands: models (being written)."""

from llmtrace.cli.app import app  # noqa: F401
