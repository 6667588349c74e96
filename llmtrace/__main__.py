"""`python -m llmtrace` and the `llmtrace` command (pyproject's script): Ctrl-C is held from the first line on."""

import llmtrace.sigint

llmtrace.sigint.hold()  # before any other import: see llmtrace/sigint.py


def entry() -> None:
    from llmtrace.cli.main import main

    main()


if __name__ == "__main__":
    entry()
