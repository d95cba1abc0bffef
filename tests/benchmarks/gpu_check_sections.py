"""Sections for gpu_check's orchestration tests, each going wrong the way a GPU section can: hanging
(with a process of its own), raising, dying without a word. Run in gpu_check's section processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def measures(out, ctx) -> None:
    out.add("measured", 1.5, "a number")
    out.data("value", 1.5)


def hangs(out, ctx) -> None:
    """Starts a helper (as tuning starts its compile pool), says so, then never returns."""
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    out.data("helper_pid", helper.pid)
    out.add("started", "then hangs")
    time.sleep(600)


def raises(out, ctx) -> None:
    out.add("before the error", "measured")
    raise RuntimeError("CUDA error: an illegal memory access was encountered\nsecond line")


def dies(out, ctx) -> None:
    os._exit(3)


def reads_the_table(out, ctx) -> None:
    """What the table said when this section began: every earlier section is in it already."""
    out.data("table", (Path(ctx.out_dir) / "gpu_check.md").read_text())
    out.add("read", "the table")
