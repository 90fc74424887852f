"""MegaScale-Infer's offline deployment-plan search (Zhu et al. 2025, sec. 4.2), apart from the AFD runtime.

* :mod:`.model_spec` -- the MoE model's shapes from its HF config;
* :mod:`.gpu_specs` -- GPU kinds (memory, bandwidth, FLOPs, price);
* :mod:`.profiler` -- ``python -m sglang.srt.afd.planner.profiler``: measures attention / expert / communication times;
* :mod:`.perf_model` -- linear fits of a profile (or a roofline model without one);
* :mod:`.simulator` -- the ping-pong pipeline's iteration time and the fleet's throughput;
* :mod:`.plan` -- ``python -m sglang.srt.afd.planner.plan``: the search (Algorithm 1) over TP sizes, N_A, N_E, m.

Nothing here is imported by a serving process; see ``docs/afd_plan.md``.
"""
