"""The plan as a table (``python -m sglang.launch_server --dry-run``)."""

from __future__ import annotations

from sglang.srt.deployment.plan import DeploymentPlan, WorkerSpec

COLUMNS = ("#", "process", "role", "group", "rank", "node", "device", "executor", "communicator", "connector")


def _row(w: WorkerSpec, ray: bool) -> tuple:
    """One worker's cells."""
    device = w.device if not ray else ("ray GPU" if w.device.startswith("cuda") else "cpu")
    comm = w.communicator.describe() if w.is_scheduler else "-"
    return (str(w.index), w.name, w.role.value, str(w.group), f"{w.rank}/{w.tp_size}", str(w.node), device,
            w.executor.describe(), comm, w.connector.describe() if w.connector else "-")


def render_plan(plan: DeploymentPlan) -> str:
    """A fixed-width table of every process the plan starts, a header line (launcher, techniques) and its notes."""
    rows = [COLUMNS] + [_row(w, plan.uses_ray) for w in plan.workers]
    if plan.detokenizer:
        rows.append(("-", "sglang::detokenizer", "detokenizer", "-", "-", str(plan.node_rank), "cpu", "-", "-", "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = [f"deployment plan: launcher {plan.launcher}, techniques {', '.join(plan.techniques) or 'none'}, "
             f"node {plan.node_rank} of {plan.nnodes}, sockets {plan.zmq_transport}"]
    for i, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
