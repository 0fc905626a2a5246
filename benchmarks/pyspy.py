"""py-spy helpers for benchmarks: sample a process without stopping it, rank its frames."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def start_profile(pid: int, seconds: int, out: Path,
                  subprocesses: bool = False) -> subprocess.Popen | None:
    """py-spy record of ``pid`` (and its children) for ``seconds``, collapsed stacks to ``out``."""
    spy = shutil.which("py-spy")
    if spy is None:
        print("py-spy not found: no profile", file=sys.stderr)
        return None
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(seconds),
                             "--rate", "200", "--format", "raw", "--output", str(out),
                             "--nonblocking", *(["--subprocesses"] if subprocesses else [])],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)


def top_frames(raw: Path, n: int = 25) -> list[tuple[str, float]]:
    """Self-time share per leaf frame (per process) from py-spy's collapsed-stack output."""
    totals: dict[str, int] = {}
    all_samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        leaf = frames[-1]
        if frames[0].startswith("process "):  # --subprocesses: name the process too
            leaf = f"{frames[0][:60]} | {leaf}"
        totals[leaf] = totals.get(leaf, 0) + int(count)
        all_samples += int(count)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:n]
    return [(frame, count / max(all_samples, 1)) for frame, count in ranked]
