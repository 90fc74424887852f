"""Prefill/decode disaggregation (KVDirect, Chen et al. 2024): prefill and decode run in separate servers and
the decode side pulls (or, in push mode, receives) the prompt's KV with one-sided transfers.

Layout (see ``docs/pd_disaggregation.md``):

* ``transfer/``: the transport (``TransferBackend``: nixl, fake) and the KV address arithmetic.
* ``messages.py``: the msgspec control messages between prefill and decode schedulers.
* ``bootstrap.py``: the bootstrap HTTP server of a prefill server (CONNECT: ranks' transfer metadata and KV
  descriptors) and its client.
* ``agent.py``: the worker side of the KV connector (one per rank: transfer agent, control sockets).
* ``prefill.py`` / ``decode.py``: the scheduler side of the connector for each role.
* ``mini_lb.py``: the router (``python -m sglang.srt.disaggregation.mini_lb``).

Nothing here is imported by an aggregated (``--disaggregation-mode null``) server.
"""
