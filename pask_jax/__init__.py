"""PASK: Parser-Aware Structural KV Persistence, in JAX."""

__version__ = "0.1.0"
