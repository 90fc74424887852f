"""Constrained decoding: grammars (regex, JSON schema, EBNF) that mask the sampler's vocabulary.

See :mod:`sglang.srt.constrained.base_grammar_backend` for the contract the scheduler relies on.
"""
