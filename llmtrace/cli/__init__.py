"""Layer cli: one module per command, thin over the library; main.py turns errors into exit codes."""
