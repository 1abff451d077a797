"""The OpenAI-compatible server: ``create_app`` for embedding, ``kiln serve`` for the shell."""

from kiln.serve.app import create_app

__all__ = ["create_app"]
