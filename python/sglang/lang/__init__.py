"""SGLang's frontend language: ``@sgl.function`` programs built from ``gen``, ``select``, roles and ``fork``.

Layout:

- :mod:`sglang.lang.ir`: the expressions a program appends to its state (text, ``gen``, ``select``,
  role markers), :class:`~sglang.lang.ir.SglSamplingParams` and :class:`~sglang.lang.ir.SglFunction`.
- :mod:`sglang.lang.interpreter`: :class:`~sglang.lang.interpreter.StreamExecutor` (runs the
  expressions of one program state in a worker thread) and
  :class:`~sglang.lang.interpreter.ProgramState` (what the program sees as ``s``).
- :mod:`sglang.lang.run`: ``run`` / ``run_batch``.
- :mod:`sglang.lang.choices`: how ``select`` turns choice logprobs into a decision.
- :mod:`sglang.lang.chat_template`: role rendering with the model's Jinja chat template.
- :mod:`sglang.lang.backend`: :class:`RuntimeEndpoint` (an sglang server's ``/generate``),
  :class:`OpenAI` (any OpenAI-compatible API through the official client).
- :mod:`sglang.lang.runtime`: :class:`Runtime`, a server subprocess with an endpoint.

The public entry points are re-exported by :mod:`sglang.api` and ``import sglang as sgl``.
"""
