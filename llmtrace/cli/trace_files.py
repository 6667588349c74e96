"""Commands: trace_files (being written)."""

from llmtrace.cli.app import app  # noqa: F401
