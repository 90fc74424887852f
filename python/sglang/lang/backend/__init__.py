"""Backends that execute ``gen`` / ``select`` for the frontend: :class:`RuntimeEndpoint` (an sglang
server's native ``/generate``) and :class:`OpenAI` (any OpenAI-compatible API)."""
