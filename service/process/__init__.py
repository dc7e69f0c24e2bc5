"""The server process: uvicorn and its connection guards, worker processes, the `serve` command."""
