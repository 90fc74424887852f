"""Multi-node deployment through Ray (``--use-ray``): workers as Ray actors placed by placement groups.

Importing this package never imports ``ray``; only :mod:`sglang.srt.ray.launcher` and
:mod:`sglang.srt.ray.launch` do, and only the ``--use-ray`` path imports those. Install the extra with
``pip install "sglang[ray]"`` (``pip install "./python[ray]"`` from a checkout).
"""
