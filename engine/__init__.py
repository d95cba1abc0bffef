"""batchgen's continuous-batching inference engine."""

import os

# OpenMP threads that finish a parallel region sleep instead of spinning. On a shared machine (more
# runnable threads than cores) spinning threads hold the cores that the late thread of the same
# region needs: a decode step of 32 sequences measured 1344 ms spinning (libgomp's default) against
# 139 ms passive, same run. Read when torch loads its OpenMP runtime, hence here, before any torch
# import; an OMP_WAIT_POLICY already set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
