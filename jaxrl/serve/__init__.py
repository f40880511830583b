"""Serving the policy: request-level streaming on the slot engine (engine.py) and, on top of it, an
OpenAI-compatible HTTP server. Nothing here is imported by training unless a run serves."""
