"""`llmtrace serve`: the learner's page, live on this machine (Starlette on uvicorn, the optional extra `serve`)."""
