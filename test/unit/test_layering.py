"""Import layering of the engine seams: model files never import executors (techniques are executors, not
forks of model files), layers never import the model executor, the communicator is independent of layers,
and CPU-only modules never import a CUDA-only one (Triton kernels, compiled extensions)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRT = Path(__file__).resolve().parents[2] / "python" / "sglang" / "srt"
SGL_KERNEL = Path(__file__).resolve().parents[2] / "sgl-kernel" / "python" / "sgl_kernel"

CPU_MODULES = [
    "sglang.srt.models.llama", "sglang.srt.models.mixtral", "sglang.srt.models.qwen2_moe",
    "sglang.srt.models.qwen3_moe", "sglang.srt.managers.scheduler", "sglang.srt.mem_cache.kv_cache",
    "sglang.srt.mem_cache.kv_descriptor", "sglang.srt.model_executor.executors", "sglang.srt.forward_batch_info",
    "sglang.srt.batch_split", "sglang.srt.ops_ref", "sglang.srt.distributed.communicator",
    "sglang.srt.distributed.sequence_parallel", "sglang.srt.model_executor.executors.sequence_parallel",
    "sglang.srt.distributed.parallel_state", "sglang.srt.model_executor.worker_builder",
    "sglang.srt.entrypoints.worker_launcher", "sglang.srt.layers.ops", "sglang.srt.layers.stages",
    "sglang.srt.models.qwen2", "sglang.srt.models.qwen3", "sglang.srt.tokenweave", "sglang.srt.tokenweave.planner",
    "sglang.srt.tokenweave.executor", "sglang.srt.distributed.tw_communicator",
    "sglang.srt.deployment", "sglang.srt.deployment.communicator", "sglang.srt.deployment.wiring",
    "sglang.srt.tokenweave.deploy", "sglang.srt.afd.deploy", "sglang.srt.disaggregation.deploy",
    "sglang.srt.distributed.tdist_deploy", "sglang.srt.ray.deploy", "sglang.srt.model_executor.executors.registry",
]
CUDA_ONLY_PREFIXES = ("triton", "sgl_kernel", "sglang.srt.layers.triton_ops", "sglang.srt.layers.attention.triton_ops",
                      "sglang.srt.model_executor.cuda_graph_runner_cuda")


def _imports(path: Path) -> set[str]:
    """Every module name a file imports (absolute names; relative imports are resolved against its package)."""
    tree = ast.parse(path.read_text())
    root = SGL_KERNEL.parent if path.is_relative_to(SGL_KERNEL) else SRT.parents[1]
    pkg = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("path", sorted((SRT / "models").glob("*.py")), ids=lambda p: p.name)
def test_model_files_do_not_import_executors(path):
    bad = sorted(n for n in _imports(path) if n.startswith(("sglang.srt.model_executor", "sglang.srt.tokenweave",
                                                            "sglang.srt.afd", "sglang.srt.disaggregation")))
    assert not bad, f"{path.name} imports {bad}: techniques plug in as executors, never in model files"


def test_layers_do_not_import_the_model_executor():
    offenders = {p.relative_to(SRT).as_posix(): sorted(n for n in _imports(p) if n.startswith("sglang.srt.model_executor"))
                 for p in (SRT / "layers").rglob("*.py")}
    assert not {k: v for k, v in offenders.items() if v}


@pytest.mark.parametrize("path", sorted(SGL_KERNEL.rglob("*.py")), ids=lambda p: p.relative_to(SGL_KERNEL).as_posix())
def test_sgl_kernel_imports_nothing_from_sglang(path):
    """``sgl_kernel`` sits below ``sglang``: whatever it needs from the serving layer is passed in (the NIXL agent of
    the M2N NIXL transport, the environment of the tdist rank launcher)."""
    bad = sorted(n for n in _imports(path) if n == "sglang" or n.startswith("sglang."))
    assert not bad, f"sgl_kernel/{path.relative_to(SGL_KERNEL).as_posix()} imports {bad}"


def test_sgl_kernel_layering_check_sees_imports():
    """The check above reads absolute and function-local imports (it would catch the old lazy import)."""
    probe = SGL_KERNEL / "m2n" / "nixl_transport.py"
    assert "sgl_kernel.m2n.base" in _imports(probe)


def test_serving_code_does_not_import_the_afd_planner():
    """The offline deployment-plan search (``afd/planner/``) is apart from the runtime: no serving module imports it."""
    offenders = {p.relative_to(SRT).as_posix(): sorted(n for n in _imports(p) if n.startswith("sglang.srt.afd.planner"))
                 for p in SRT.rglob("*.py") if "planner" not in p.relative_to(SRT).parts}
    assert not {k: v for k, v in offenders.items() if v}


def test_communicator_is_independent_of_layers():
    for name in ("communicator.py", "parallel_state.py"):
        bad = sorted(n for n in _imports(SRT / "distributed" / name) if n.startswith("sglang.srt.layers"))
        assert not bad, f"distributed/{name} imports {bad}"


def test_no_bottom_of_file_import_cycle():
    """``layers/ops.py`` imports only the references; no layer module imports ``ops`` after its definitions."""
    assert not any(n.startswith("sglang.srt.layers.") and n != "sglang.srt.layers.triton_ops"
                   for n in _imports(SRT / "layers" / "ops.py")), "layers/ops.py must not import layer modules"
    for p in (SRT / "layers").rglob("*.py"):
        tree = ast.parse(p.read_text())
        seen_def = False
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                seen_def = True
            elif seen_def and isinstance(node, (ast.Import, ast.ImportFrom)):
                pytest.fail(f"{p.relative_to(SRT)} imports after its definitions (an import cycle workaround)")


def test_cpu_modules_import_no_cuda_only_module():
    code = ("import sys, importlib\n"
            f"for m in {CPU_MODULES!r}: importlib.import_module(m)\n"
            f"bad = sorted(m for m in sys.modules if m.startswith({CUDA_ONLY_PREFIXES!r}))\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", f"CPU modules pulled in CUDA-only modules: {out.stdout.strip()}"


NVLS_SETTERS = ('"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"', '"NCCL_NVLS_ENABLE": "0"', 'setdefault("NCCL_NVLS_ENABLE"',
                'environ["NCCL_NVLS_ENABLE"]', 'setdefault("NVSHMEM_DISABLE_NVLS"', 'environ["NVSHMEM_DISABLE_NVLS"]')


def test_nvls_env_defined_once():
    """The multicast-off environment is written in one place (utils/nvls_env.py): library, benchmarks and the
    test helpers that start processes import it (tests may still spell the values out to check them)."""
    root = SRT.parents[2]
    files = list((root / "python").rglob("*.py")) + list((root / "benchmark").rglob("*.py"))
    files += [root / "test" / "conftest.py", root / "test" / "server_utils.py"]
    files += list((root / "test" / "gpu").rglob("*.py"))
    hits = []
    for p in files:
        text = p.read_text()
        if p.name != "nvls_env.py" and any(s in text for s in NVLS_SETTERS):
            hits.append(str(p.relative_to(root)))
    assert not hits, f"NVLS-off environment re-defined in {hits}; import it from sglang.srt.utils.nvls_env"


def test_benchmarks_and_the_library_do_not_import_tests():
    """Benchmarks and ``sglang`` import shared helpers from :mod:`sglang.test`, never from ``test/`` (which may be
    absent where the package is installed): no import of a ``test/`` module, no ``test`` folder path."""
    root = SRT.parents[2]
    test_modules = {p.stem for p in (root / "test").rglob("*.py")} - {"__init__"}
    files = sorted((root / "benchmark").rglob("*.py")) + sorted((root / "python" / "sglang").rglob("*.py"))
    bad = {}
    for p in files:
        tree = ast.parse(p.read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree)
                  if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module}
        names &= test_modules
        if any(isinstance(n, ast.Constant) and n.value == "test" for n in ast.walk(tree)):  # ROOT / "test" / ...
            names.add('a "test" path')
        if names:
            bad[p.relative_to(root).as_posix()] = sorted(names)
    assert not bad, f"imports from test/: {bad}"



def test_benchmark_modules_form_no_import_cycle():
    """Benchmarks import each other as ``benchmark.<subject>.<module>`` and only downwards: entry points import
    libraries, never the other way round, so no module of ``benchmark/`` is imported while it is still loading (an
    entry point run as a file would otherwise be loaded a second time under its package name)."""
    root = SRT.parents[2]
    mods = {".".join(p.relative_to(root).with_suffix("").parts): p for p in (root / "benchmark").rglob("*.py")
            if p.name != "__init__.py"}
    graph = {}
    for name, p in mods.items():
        deps = set()
        for n in ast.walk(ast.parse(p.read_text())):
            targets = []
            if isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                targets = [n.module] + [f"{n.module}.{a.name}" for a in n.names]
            deps |= {t for t in targets if t in mods and t != name}
        graph[name] = deps
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d] if d in stack else [m, d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, f"import cycles among benchmark modules: {cycles}"

def test_gpu_scripts_set_the_nvls_off_environment():
    """Every ``scripts/gpu/*.sh`` run sets NVLS/multicast off: through ``device_preamble.sh`` (the common start, sourced
    by the script or by a ``scripts/gpu`` helper it sources first) or, for a script that
    does not source it yet, by itself. ``lib_*.sh`` are helpers sourced after the preamble."""
    gpu = SRT.parents[2] / "scripts" / "gpu"
    preamble = (gpu / "device_preamble.sh").read_text()
    settings = ("NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1", "NVSHMEM_DISABLE_NVLS=1")
    assert all(s in preamble for s in settings)
    host_only = ("device_preamble.sh", "stage_shared_data.sh", "build_nixl_slim_wheel.sh",  # not run on the device
                 "build_flashinfer_slim_wheels.sh")

    def sources_preamble(p) -> bool:
        text = p.read_text()
        if 'device_preamble.sh"' in text:
            return True
        helpers = re.findall(r'^\s*(?:\.|source) "\$\(dirname "\$0"\)/([\w.-]+\.sh)"', text, re.M)
        return any('device_preamble.sh"' in (gpu / h).read_text() for h in helpers if (gpu / h).is_file())

    missing = [p.name for p in sorted(gpu.glob("*.sh")) if p.name not in host_only and not p.name.startswith("lib_")
               and not sources_preamble(p) and not all(s in p.read_text() for s in settings)]
    assert not missing, f"{missing}: source device_preamble.sh first"
