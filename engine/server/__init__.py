"""`stowage serve`: an OpenAI-compatible HTTP API over the engine, with continuous batching (docs/server.md).

schemas (requests in) -> app (HTTP) -> scheduler (the engine's thread; prefix_pool) -> responses (objects out);
cli registers the subcommand."""

UNIX_SCHEME = "unix:"  # the base URL of a server on a Unix socket, `unix:/path/to.sock` (serve --unix; the client)
