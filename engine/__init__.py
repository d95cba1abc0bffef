"""batchgen's continuous-batching inference engine."""

from engine.config import EngineConfig
from engine.openmp import no_spin_unless_chosen, set_openmp_defaults, share_cpus
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import IterationStats, RequestStats

__all__ = ["LLM", "LLMEngine", "EngineConfig", "IterationStats", "RequestOutput", "RequestStats",
           "SamplingParams", "no_spin_unless_chosen", "set_openmp_defaults", "share_cpus"]


def __getattr__(name: str):
    # LLM and LLMEngine import torch: load them only when asked for
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
