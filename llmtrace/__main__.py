from llmtrace.cli.main import main

main()
