"""Multi-node deployment through Ray (``--use-ray``): workers as Ray actors placed by placement groups.

Importing this package never imports ``ray``; only :mod:`sglang.srt.ray.launcher` and
:mod:`sglang.srt.ray.launch` do, and only the ``--use-ray`` path imports those. Install the extra with
``pip install "sglang[ray]"`` (``pip install "./python[ray]"`` from a checkout).

Importing it sets ``RAY_DEDUP_LOGS=0`` unless the user set it: Ray's driver-side log deduplication drops every word
that contains a digit before comparing lines, so ``[... Scheduler TP1] ...`` reads the same as ``[... Scheduler TP0]
...`` and the remote rank's lines vanish into a ``[repeated 2x across cluster]`` note. Ray reads the variable when it
is first imported, so this holds for the server process (``launch_server``, ``ray job submit``); an ``sgl.Engine``
in a program that imported ``ray`` before keeps Ray's setting.
"""

import os

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
