"""The `cadenza` command: generate, chat, serve and bench (cli.main)."""
