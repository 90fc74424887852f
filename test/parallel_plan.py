"""How the suite runs on parallel pytest-xdist workers (``scripts/run_tests.sh`` passes ``-n N --dist loadfile``).

* Unit of work: one test file (its module-scoped servers and process groups are started once, on one worker), or
  one group of files listed in :data:`SHARED_GROUPS`, which run one after the other on a single worker because they
  must not overlap (the Ray clusters: ``ray`` commands and ``address="auto"`` look for "the" cluster in the shared
  ``/tmp/ray`` session folder).
* Order: the files of :data:`HEAVY_FIRST` (the longest, measured with ``--durations`` on the 2-core CI machine)
  start first, longest first, the rest follow in collection order; a short file then fills whichever worker frees
  up, so the run ends close to when its longest file does (instead of a long file starting last).
* Ports: every server, router and process group of a test takes a free port when it starts
  (``server_utils.free_port``, below the kernel's ephemeral range), so workers never clash; IPC sockets and
  temporary folders are private folders made with ``mkdtemp``; network-namespace tests name their namespaces
  after the worker's pid.

Serial runs (no ``-n``, or ``-n 0``) are unchanged: collection order, no scheduler.
"""

from __future__ import annotations

SHARED_GROUPS = {
    "test/integration/test_ray_cluster.py": "ray-clusters",
    "test/integration/test_ray_netns.py": "ray-clusters",
}
"""file -> group: the files of one group run on one worker, one after the other."""

HEAVY_FIRST = (
    "ray-clusters",
    "test/integration/test_afd_server.py",
    "test/integration/test_server_e2e.py",
    "test/unit/test_afd_device_step.py",
    "test/unit/test_bench_tokenweave.py",
    "test/integration/test_tp_cpu.py",
    "test/integration/test_pd_faults.py",
    "test/unit/test_two_batch_overlap_ep.py",
    "test/unit/test_ep_a2a.py",
    "test/integration/test_pd_hetero_tp.py",
    "test/unit/test_ep_dp_tbo_schedules.py",
    "test/integration/test_docs_quickstart.py",
    "test/integration/test_tokenweave_server.py",
    "test/integration/test_dp_attention_server.py",
    "test/integration/test_bench_serving.py",
    "test/integration/test_pd_dynamic_workers.py",
    "test/integration/test_pd_disaggregation.py",
    "test/integration/test_overlap_server.py",
    "test/integration/test_multinode_cpu.py",
    "test/unit/test_tw_comm_compile.py",
    "test/unit/test_bench_afd.py",
    "test/unit/test_tdist_spawn.py",
    "test/integration/test_fp8_server.py",
    "test/integration/test_seams_server.py",
    "test/unit/test_triton_attention.py",
    "test/unit/test_tdist_interpret.py",
    "test/integration/test_engine.py",
    "test/integration/test_pd_two_nodes.py",
    "test/integration/test_sglang_client_parity.py",
)
"""The longest files (or groups), longest first: the per-file sum of a ``--junitxml`` report of a whole run on 3
workers of a 2-core machine (2026-12-07; every file above 50 s there); re-measure when a file grows past the last one
here."""


def work_unit(nodeid: str) -> str:
    """The unit of work (a file, or its :data:`SHARED_GROUPS` group) of a test id."""
    path = nodeid.split("::", 1)[0]
    return SHARED_GROUPS.get(path, path)


def heavy_first(items: list) -> None:
    """Sort ``items`` (in place, stable) so that the tests of :data:`HEAVY_FIRST` come first, longest file first;
    every file keeps its own order of tests."""
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    last = len(HEAVY_FIRST)
    items.sort(key=lambda item: rank.get(work_unit(item.nodeid), last))


def make_scheduler(config, log):
    """``--dist loadfile`` with :func:`work_unit` as the unit and the collection order kept (the workers sorted it
    with :func:`heavy_first`; xdist would otherwise put files with the most tests first)."""
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        """One work unit per test file or :data:`SHARED_GROUPS` group, in collection order."""

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False
    return FileGroupScheduling(config, log)
