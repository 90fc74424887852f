#!/usr/bin/env python3
"""Download a wheelhouse of sglang-tw's runtime dependencies for another Python and platform.

Reads the requirements of ``python/pyproject.toml`` (and ``sgl-kernel/pyproject.toml``), then
walks the dependency graph by reading each downloaded wheel's ``METADATA`` (``Requires-Dist``,
markers evaluated for the target Python/platform and the requested extras), skipping every
package named in the "already present" file (with its whole subtree: what the target image
has, it has with its dependencies). Each package is fetched with ``pip download --no-deps
--only-binary=:all:`` for the target tags; when a later requirement tightens a package's
specifier so that the wheel already fetched no longer satisfies it, that wheel is replaced.

Writes into the wheelhouse: the wheels, ``requirements.txt`` (the top-level requirements to
install) and ``requirements.lock`` (every wheel as ``name==version``).

Run through ``scripts/build_wheelhouse.sh``; ``--help`` lists the options.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import zipfile
from collections import deque
from email.parser import Parser

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # pip vendors packaging
    from pip._vendor.packaging.requirements import Requirement  # type: ignore
    from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore
    from pip._vendor.packaging.version import Version  # type: ignore

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = None


IN_REPO_PACKAGES = {"sglang", "sgl-kernel"}
"""Canonical names of the packages this repo builds itself (never fetched into a wheelhouse)."""


def read_pyproject_requirements(path: str, extras: list[str]) -> list[str]:
    """``[project].dependencies`` plus the named optional-dependency groups of ``path``."""
    with open(path, "rb") as f:
        if tomllib is not None:
            data = tomllib.load(f)
        else:
            import tomli  # type: ignore

            data = tomli.load(f)
    proj = data.get("project", {})
    reqs = list(proj.get("dependencies", []))
    groups = proj.get("optional-dependencies", {})
    for e in extras:
        if e not in groups:
            raise SystemExit(f"error: extra {e!r} is not in {path} (has: {', '.join(sorted(groups)) or 'none'})")
        reqs += groups[e]
    return reqs


def read_present(path: str) -> set[str]:
    """Canonical names from a ``pip freeze`` / ``pip list --format=freeze`` file or a plain list."""
    names: set[str] = set()
    if not path:
        return names
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line or line.startswith("-"):
                continue
            m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)", line)
            if m:
                names.add(canonicalize_name(m.group(1)))
    return names


def target_env(python_version: str) -> dict[str, str]:
    """PEP 508 marker environment of CPython ``python_version`` on Linux x86_64."""
    full = python_version if python_version.count(".") == 2 else python_version + ".0"
    return {"python_version": ".".join(full.split(".")[:2]), "python_full_version": full, "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "platform_release": "", "platform_version": "", "implementation_name": "cpython",
            "implementation_version": full, "platform_python_implementation": "CPython", "extra": ""}


def platform_tags(glibc_minor: int) -> list[str]:
    """manylinux tags for x86_64 up to glibc 2.``glibc_minor`` (newest first, legacy aliases included)."""
    tags = [f"manylinux_2_{m}_x86_64" for m in range(glibc_minor, 4, -1)]
    return tags + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def wheel_name_version(filename: str) -> tuple[str, Version]:
    parts = filename[:-4].split("-")
    return canonicalize_name(parts[0]), Version(parts[1])


def wheels_in(folder: str) -> dict[str, str]:
    """Canonical name -> wheel filename of every wheel in ``folder``."""
    out = {}
    for fn in os.listdir(folder):
        if fn.endswith(".whl"):
            out[wheel_name_version(fn)[0]] = fn
    return out


def requires_dist(wheel_path: str) -> list[str]:
    """``Requires-Dist`` entries of a wheel's METADATA."""
    with zipfile.ZipFile(wheel_path) as z:
        meta = next(n for n in z.namelist() if re.match(r"^[^/]+\.dist-info/METADATA$", n))
        msg = Parser().parsestr(z.read(meta).decode("utf-8", errors="replace"))
    return msg.get_all("Requires-Dist") or []


def marker_ok(req: Requirement, env: dict[str, str], extras: set[str]) -> bool:
    if req.marker is None:
        return True
    for e in sorted(extras) or [""]:
        if req.marker.evaluate({**env, "extra": e}):
            return True
    return False


def pip_download(spec: str, dest: str, pyver: str, tags: list[str]) -> None:
    abi = "cp" + pyver.replace(".", "")[:3]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", pyver,
           "--implementation", "cp", "--abi", abi, "--dest", dest, "--disable-pip-version-check", "-q"]
    for t in tags:
        cmd += ["--platform", t]
    r = subprocess.run(cmd + [spec], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"error: pip download {spec!r} failed (no wheel for CPython {pyver} on manylinux x86_64?):\n"
                         f"{r.stderr[-2000:]}")


def resolve(top: list[str], dest: str, present: set[str], pyver: str, tags: list[str]) -> dict[str, str]:
    """Download wheels for ``top`` and their dependencies; returns name -> wheel filename."""
    env = target_env(pyver)
    specs: dict[str, SpecifierSet] = {}
    extras: dict[str, set[str]] = {}
    why: dict[str, str] = {}
    queue = deque((Requirement(r), "pyproject") for r in top)
    done: dict[str, str] = {}
    have = wheels_in(dest)
    while queue:
        req, parent = queue.popleft()
        if not marker_ok(req, env, extras.get(canonicalize_name(parent), set()) if parent != "pyproject" else set()):
            continue
        name = canonicalize_name(req.name)
        if name in present:
            continue
        old_spec, old_extras = specs.get(name), extras.get(name, set())
        specs[name] = (old_spec & req.specifier) if old_spec is not None else req.specifier
        extras[name] = old_extras | set(req.extras)
        why.setdefault(name, parent)
        fn = done.get(name) or have.get(name)
        ok = fn is not None and specs[name].contains(wheel_name_version(fn)[1], prereleases=True)
        if ok and name in done and extras[name] == old_extras and specs[name] == old_spec:
            continue
        if not ok:
            if fn is not None:
                os.remove(os.path.join(dest, fn))
            spec = f"{req.name}{specs[name]}"
            print(f"  fetch {spec}  (needed by {why[name]})", flush=True)
            pip_download(spec, dest, pyver, tags)
            have = wheels_in(dest)
            fn = have.get(name)
            if fn is None:
                raise SystemExit(f"error: pip download {spec!r} produced no wheel named {name}")
        done[name] = fn
        for rd in requires_dist(os.path.join(dest, fn)):
            queue.append((Requirement(rd), name))
    for name, fn in done.items():  # the final specifiers must all hold
        if not specs[name].contains(wheel_name_version(fn)[1], prereleases=True):
            raise SystemExit(f"error: {fn} does not satisfy {name}{specs[name]}")
    return done


def main() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dest", required=True, help="Wheelhouse folder (created).")
    p.add_argument("--present", default=os.path.join(root, "scripts", "wheelhouse_present.txt"),
                   help="Packages the target already has (pip freeze output or one name per line); '' for none.")
    p.add_argument("--python-version", default="3.12")
    p.add_argument("--glibc", default="2.35", help="Target glibc (manylinux tags up to it). Ubuntu 22.04: 2.35.")
    p.add_argument("--extras", default="test", help="Comma-separated optional-dependency groups of sglang.")
    p.add_argument("--extra-req", action="append", default=[],
                   help="Additional requirement (repeatable), e.g. xgrammar for grammar-constrained decoding.")
    args = p.parse_args()
    extras = [e for e in args.extras.split(",") if e]
    top = read_pyproject_requirements(os.path.join(root, "python", "pyproject.toml"), extras)
    kernel = os.path.join(root, "sgl-kernel", "pyproject.toml")
    if os.path.exists(kernel):
        top += read_pyproject_requirements(kernel, [])
    top += args.extra_req
    # the repo's own packages (sglang pins sgl-kernel) are installed from the checkout, not from an index
    top = [r for r in top if canonicalize_name(Requirement(r).name) not in IN_REPO_PACKAGES]
    present = read_present(args.present)
    os.makedirs(args.dest, exist_ok=True)
    glibc_minor = int(args.glibc.split(".")[1])
    print(f"resolving {len(top)} top-level requirements for CPython {args.python_version} manylinux x86_64 "
          f"(glibc <= {args.glibc}); {len(present)} packages already present", flush=True)
    done = resolve(top, args.dest, present, args.python_version, platform_tags(glibc_minor))
    for fn in set(wheels_in(args.dest).values()) - set(done.values()):
        os.remove(os.path.join(args.dest, fn))  # left over from an earlier run with other inputs
    top_names = []
    for r in top:
        req = Requirement(r)
        if canonicalize_name(req.name) in done and marker_ok(req, target_env(args.python_version), set()):
            top_names.append(str(req))
    with open(os.path.join(args.dest, "requirements.txt"), "w") as f:
        f.write("\n".join(sorted(set(top_names))) + "\n")
    with open(os.path.join(args.dest, "requirements.lock"), "w") as f:
        for name in sorted(done):
            f.write(f"{name}=={wheel_name_version(done[name])[1]}\n")
    print(f"wheelhouse {args.dest}: {len(done)} wheels; skipped as present: "
          f"{', '.join(sorted(present & {canonicalize_name(Requirement(r).name) for r in top})) or 'none'}")


if __name__ == "__main__":
    main()
