"""OpenMP: the waiting an engine process starts with, and the threads an engine steps on.

Threads that finish a parallel region spin briefly, then sleep: libgomp's default spins far longer,
which on a machine with more runnable threads than cores holds the cores that the late thread of the
same region needs. libgomp reads these variables once, when torch loads it, so nothing is set when
the engine is imported: the entry points (`batchgen`'s main, a worker) call set_openmp_defaults()
before anything imports torch. A setting already made wins. Engines that share their cores (several
workers on one machine) do not spin at all (no_spin_unless_chosen). The measurements behind these
numbers are in docs/benchmarks.md ("OpenMP waiting").
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

from kernels.cpu_features import usable_cpus

THREADS_ENV = "OMP_NUM_THREADS"

OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "20000"}
# the variables set_openmp_defaults() set in this process (not the user's): the vLLM baseline drops
# them, since vLLM waits its own way
SET_BY_ENGINE: frozenset[str] = frozenset()


def set_openmp_defaults() -> frozenset[str]:
    """Set each of OPENMP_DEFAULTS in os.environ that is not set yet; returns those it set. Call it
    before torch is imported (later, libgomp has read them already). Idempotent."""
    global SET_BY_ENGINE
    made = frozenset(k for k in OPENMP_DEFAULTS if k not in os.environ)
    for name in made:
        os.environ[name] = OPENMP_DEFAULTS[name]
    SET_BY_ENGINE = SET_BY_ENGINE | made
    return made


def no_spin_unless_chosen(env: MutableMapping[str, str]) -> None:
    """For an engine that may share its cores: GOMP_SPINCOUNT 0 in env (a dict or os.environ),
    unless the spin there is someone's choice rather than this default."""
    if "GOMP_SPINCOUNT" in SET_BY_ENGINE:
        env["GOMP_SPINCOUNT"] = "0"


def share_cpus(env: MutableMapping[str, str], engines: int) -> None:
    """For `engines` engines started together on this machine: each gets its share of the CPUs this
    process may use ($OMP_NUM_THREADS in env, which engine_threads reads), unless one was set."""
    if THREADS_ENV not in env:
        env[THREADS_ENV] = str(max(1, engine_threads(None, {}) // max(1, engines)))


def engine_threads(configured: int | None = None, environ: Mapping[str, str] | None = None) -> int:
    """The threads a CPU engine's steps run on: `configured` (--cpu-threads), else $OMP_NUM_THREADS,
    else every CPU this process may run on (its affinity mask), as vLLM's CPU backend binds its threads.

    Not torch's own default: torch gives the main thread one thread per physical core, while a thread
    started later (a worker's engine loop) got every logical CPU, so the same engine ran at two speeds
    (2x on a 2-vCPU VM with SMT siblings) depending on which thread stepped it. The engine sets this
    count on whichever thread steps it."""
    if configured is not None:
        return configured
    raw = (os.environ if environ is None else environ).get(THREADS_ENV, "").split(",")[0].strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{THREADS_ENV} must be a number of threads, got {raw!r}") from None
        if value < 1:
            raise ValueError(f"{THREADS_ENV} must be >= 1, got {raw!r}")
        return value
    return usable_cpus()
