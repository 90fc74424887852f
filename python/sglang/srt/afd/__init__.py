"""MegaScale-Infer attention/FFN disaggregation (AFD, Zhu et al. 2025): the runtime here (launch, ping-pong
executor, FFN workers, wire protocol, expert load balancing); the offline deployment-plan search in
:mod:`sglang.srt.afd.planner`."""
