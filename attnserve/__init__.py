"""The `attnserve` command line: the root above every package (model, service, export, bench)."""
