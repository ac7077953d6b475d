"""A minimal OpenAI-compatible server over a continuous-batching PASK engine.

``Engine`` (serve.engine) owns the paged cache, the FIFO admission queue and the jitted decode
step; ``create_app`` (serve.app) is the ASGI app; ``pask-jax serve`` runs it with uvicorn.
"""
from serve.engine import Engine, Request

__all__ = ["Engine", "Request"]
