"""Write scripts/constraints.txt: the versions of diffmeg's dependencies (every extra setup.sh installs,
and what they pull in) as installed now, for setup.sh to install exactly what the suite passed with.

Run it after the suite passed on a machine set up by setup.sh with the constraints removed (or after an
upgrade):   python3 scripts/freeze_constraints.py
pyproject.toml keeps ranges for library users; this file pins a fresh machine to a tested set.
torch and its CUDA/triton companions are left out (setup.sh keeps whatever torch is installed), and so
are pip and setuptools.
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

EXTRAS = ("dev", "mpi", "hf", "eval", "harness")  # setup.sh's `-e .[...]`
ALSO = ("deepspeed",)  # installed by setup.sh on its own
LEFT_OUT = re.compile(r"^(torch|triton|nvidia-.*|pytorch-triton.*|diffmeg|pip|setuptools|wheel)$")
OUT = Path(__file__).with_name("constraints.txt")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(dist: metadata.Distribution, extras: tuple[str, ...] = ()) -> list[tuple[str, tuple]]:
    """The (name, extras) this distribution requires, with `extras` enabled and platform markers read."""
    found = []
    for line in dist.requires or []:
        spec, _, marker = line.partition(";")
        match = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(\[[^\]]*\])?", spec)
        if match is None:
            continue
        marker = marker.strip()
        wanted = [m for m in re.findall(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)]
        if wanted and not set(wanted) & set(extras):
            continue
        if marker and not wanted and not _marker_holds(marker):
            continue
        sub = tuple(e.strip() for e in (match.group(2) or "[]")[1:-1].split(",") if e.strip())
        found.append((match.group(1), sub))
    return found


def _marker_holds(marker: str) -> bool:
    try:
        from packaging.markers import Marker
    except ImportError:
        return True
    return Marker(marker).evaluate({"extra": ""})


def closure() -> dict[str, str]:
    pinned: dict[str, str] = {}
    todo = [("diffmeg", EXTRAS), *((name, ()) for name in ALSO)]
    seen: set[tuple[str, tuple]] = set()
    while todo:
        name, extras = todo.pop()
        if (canonical(name), extras) in seen:
            continue
        seen.add((canonical(name), extras))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional dependency for another platform
        if not LEFT_OUT.match(canonical(name)):
            pinned[canonical(dist.metadata["Name"])] = dist.version
        todo.extend(requirement_names(dist, extras))
    return pinned


def main() -> None:
    pinned = closure()
    lines = [f"{name}=={version}" for name, version in sorted(pinned.items())]
    header = (
        "# Versions the test suite passed with; setup.sh installs with `-c` this file.\n"
        "# Regenerate with: python3 scripts/freeze_constraints.py (see its docstring). torch is not pinned.\n"
    )
    OUT.write_text(header + "\n".join(lines) + "\n")
    print(f"wrote {OUT} ({len(lines)} packages)")


if __name__ == "__main__":
    main()
