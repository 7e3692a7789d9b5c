"""What every benchmark result records about where it ran: the machine, the versions, the
commit. Used by the scripts in ``benchmarks/``."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def git_commit(root: Path = ROOT) -> str | None:
    """HEAD of the checkout at ``root``, read from ``.git`` (no git process); None when
    there is no readable checkout (an installed package, a copy)."""
    git = root / ".git"
    try:
        gitdir = git
        if git.is_file():  # a worktree: "gitdir: <path>"
            gitdir = (root / git.read_text().split(":", 1)[1].strip()).resolve()
        common = gitdir
        if (gitdir / "commondir").is_file():
            common = (gitdir / (gitdir / "commondir").read_text().strip()).resolve()
        head = (gitdir / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        for base in (gitdir, common):
            if (base / ref).is_file():
                return (base / ref).read_text().strip()
        packed = common / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0]
    except OSError:
        return None
    return None


def tree_cpu_seconds() -> float | None:
    """CPU seconds (user + system) used so far by this process and its direct children (a
    server's worker processes), read from ``/proc``; None where there is none. Less sensitive
    to other load on a small host than wall time: a ratio of CPU per request tells what the
    runtime costs when the wake-ups between its processes and threads are set aside."""
    me = os.getpid()
    try:
        kids = Path(f"/proc/{me}/task/{me}/children").read_text().split()
        pids = [str(me), *kids]
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for pid in pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # a child that ended since
                continue
            total += int(fields[11]) + int(fields[12])  # utime, stime (after pid, comm)
        return total / tick
    except (OSError, ValueError, IndexError):
        return None


def machine_info() -> dict[str, Any]:
    """CPU count, load average, Python and torch versions, and the git commit."""
    import torch

    return {
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "git_commit": git_commit(),
    }


def write_result(path: Path, result: dict[str, Any], loadavg_before: Any = None) -> None:
    """Write ``result`` to ``path`` as JSON, with where it ran: CPU count, torch threads and
    version, Python, git commit, and the load average when the measurement began
    (``loadavg_before``: ``os.getloadavg()`` then) and now."""
    import json

    import torch

    record = {
        **result,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "loadavg_before": loadavg_before,
        "loadavg_after": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
