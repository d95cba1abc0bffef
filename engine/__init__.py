"""batchgen's continuous-batching inference engine."""

import os

# OpenMP threads that finish a parallel region sleep instead of spinning. On a shared machine (more
# runnable threads than cores) spinning threads hold the cores that the late thread of the same
# region needs: a decode step of 32 sequences measured 1344 ms spinning (libgomp's default) against
# 139 ms passive, same run. Read when torch loads its OpenMP runtime, hence here, before any torch
# import. But first they spin briefly (GOMP_SPINCOUNT counts busy-wait turns, about 0.2 ms here): a
# decode step runs a parallel region per op, a few hundred of them with a little Python between,
# and waking sleeping threads for each cost more than the op (silu_and_mul of 64 rows: 36 us
# spinning, 167 passive). Alone on 2 cores a 32-sequence bf16 step took 60 ms against 81 passive;
# with a second engine on the same cores, 243 against 106. So a `batchgen worker` started on its own
# (it may share its machine), `batchgen run --workers N` (N > 1) and the test suite set no spin; a
# `batchgen run` with one worker hands it the spin. A setting already made wins;
# SET_BY_ENGINE names the ones made here (the vLLM baseline drops them: vLLM runs with its own).
OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "20000"}
SET_BY_ENGINE = frozenset(k for k in OPENMP_DEFAULTS if k not in os.environ)
for _name in SET_BY_ENGINE:
    os.environ[_name] = OPENMP_DEFAULTS[_name]


def no_spin_unless_chosen(env) -> None:
    """For an engine that may share its cores: GOMP_SPINCOUNT 0 in env (a dict or os.environ),
    unless the spin there is someone's choice rather than this default."""
    if "GOMP_SPINCOUNT" in SET_BY_ENGINE:
        env["GOMP_SPINCOUNT"] = "0"

from engine.config import EngineConfig  # noqa: E402
from engine.outputs import RequestOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.stats import IterationStats, RequestStats  # noqa: E402

__all__ = ["LLM", "LLMEngine", "EngineConfig", "IterationStats", "RequestOutput", "RequestStats",
           "SamplingParams"]


def __getattr__(name: str):
    # LLM and LLMEngine import torch: load them only when asked for
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
