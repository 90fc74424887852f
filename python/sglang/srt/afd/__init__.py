"""MegaScale-Infer attention/FFN disaggregation (AFD): runtime, deployment planner, expert load balancing."""
