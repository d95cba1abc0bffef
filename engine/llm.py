"""`LLM`: the offline facade, as in vLLM. Give it prompts, get outputs in the same order."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import IterationStats

Prompt = str | list[int]


class LLM:
    """from engine import LLM, SamplingParams; LLM(model="smollm2-135m").generate(prompts, params).

    Keyword arguments are EngineConfig fields (max_num_seqs, max_num_batched_tokens, dtype, ...).
    `iteration_stats` holds one IterationStats per engine step of the latest generate() call.
    """

    def __init__(self, model: str = "smollm2-135m", *, checkpoint=None, **config) -> None:
        self.config = EngineConfig(model=model, **config)
        self.iteration_stats: list[IterationStats] = []
        self.engine = LLMEngine(self.config, checkpoint=checkpoint,
                                stat_loggers=[self.iteration_stats.append])

    @classmethod
    def from_config(cls, config: EngineConfig, *, checkpoint=None) -> LLM:
        fields = {k: v for k, v in vars(config).items() if k != "model"}
        return cls(config.model, checkpoint=checkpoint, **fields)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt (text or token ids) to completion; outputs come back in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        requests = [{"prompt": p} for p in prompts]
        return self._run(requests, sampling_params, use_tqdm)

    def chat(
        self,
        conversations: list[dict] | Seq[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Like generate(), for chat messages ([{"role": ..., "content": ...}, ...]) per request."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self._run([{"messages": c} for c in conversations], sampling_params, use_tqdm)

    def _run(self, requests: list[dict], sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        params = _per_request(sampling_params, len(requests))
        self.iteration_stats.clear()
        ids = [self.engine.add_request(None, params=p, **r) for r, p in zip(requests, params, strict=True)]
        done: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm else None
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                done[out.request_id] = out
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]


def _per_request(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if len(sampling_params) != n:
        raise ValueError(f"got {len(sampling_params)} sampling params for {n} prompts")
    return list(sampling_params)


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="req", dynamic_ncols=True)
