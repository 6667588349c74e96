from llmtrace.cli import main

main()
