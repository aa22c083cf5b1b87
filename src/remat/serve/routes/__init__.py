"""The server's routes, one router per feature."""

from remat.serve.routes import adapters, chat, completions, health, tokens, train

ROUTERS = [health.router, tokens.router, completions.router, chat.router, adapters.router, train.router]
