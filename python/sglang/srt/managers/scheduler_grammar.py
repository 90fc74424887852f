"""The grammar queue of :class:`~sglang.srt.managers.scheduler.Scheduler`: requests with a regex,
json_schema or ebnf constraint wait here (not in ``waiting``) while the grammar backend compiles
their grammar on its own threads, so compilation never blocks a step.

Contract with the scheduler (the mixin's host must provide): ``grammar_queue``, ``waiting``,
``outputs``, ``runner`` (``parallel_state``, ``tp_size``) and ``control_group``.
"""

from __future__ import annotations

import concurrent.futures as cf

import torch


class SchedulerGrammarMixin:
    """Polls grammar compilations and admits requests whose grammar is ready on every TP rank."""

    def _poll_grammar_queue(self) -> None:
        """Move requests whose grammar compiled to ``waiting``; fail those whose grammar is invalid."""
        if not self.grammar_queue:
            return
        ready = self._agree_ready([r.grammar_future.done() for r in self.grammar_queue])
        still = []
        for req, ok in zip(self.grammar_queue, ready):
            fut = req.grammar_future
            if not ok:
                still.append(req)
                continue
            req.grammar_future = None
            try:
                req.grammar = fut.result()
            except Exception as e:  # ValueError naming the problem, or an unexpected compile failure
                req.finished_reason = {"type": "abort", "message": str(e), "status_code": 400}
                self.outputs.append(req)
                continue
            self.waiting.append(req)
        self.grammar_queue = still

    def _agree_ready(self, ready: list[bool]) -> list[bool]:
        """With tensor parallelism, a request leaves the grammar queue only once its grammar is ready
        on every rank (compilation times differ per rank; batches must not). One small CPU all-reduce
        per step while the queue is non-empty; a no-op on one rank."""
        ps = self.runner.parallel_state
        if ps is None or self.runner.tp_size <= 1:
            return ready
        import torch.distributed as dist

        flags = torch.tensor(ready, dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.control_group or ps.cpu_group)
        return [bool(x) for x in flags.tolist()]

    def _wait_for_grammars(self, timeout: float) -> None:
        """Block up to ``timeout`` s for a compilation to finish (only when nothing else can run)."""
        futs = [r.grammar_future for r in self.grammar_queue if r.grammar_future is not None]
        if futs:
            cf.wait(futs, timeout=timeout, return_when=cf.FIRST_COMPLETED)
