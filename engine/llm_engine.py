"""LLMEngine: requests in, one iteration per `step()`, finished outputs and telemetry out.

This is the streaming interface a long-lived worker drives (add requests any time, step until
done); `engine.llm.LLM` wraps it for offline `generate()`. Per-iteration stats go to the stat
loggers the caller registers; the engine itself keeps no per-step history.
"""

from __future__ import annotations

import itertools
import logging
import operator
import os
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.families import read_model_args
from engine.faults import EngineFault, is_device_fault
from engine.model import ModelArgs, Transformer
from engine.model_runner import DTYPES, ModelRunner, kv_block_bytes
from engine.openmp import engine_threads
from engine.outputs import RequestOutput
from engine.sampler import Sampled, Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from engine.stats import IterationStats
from engine.structured_output import StructuredOutputs

StatLogger = Callable[[IterationStats], None]
_IS_DECODE = operator.attrgetter("is_decode")
_SEQ = operator.attrgetter("seq")
_JOB_ID = operator.attrgetter("job_id")
_NEEDS_HOST_TOKENS = operator.attrgetter("needs_host_tokens")
log = logging.getLogger(__name__)

CPU_FREE_RAM_SHARE = 0.25  # KV cache on CPU without --kv-cache-memory: this share of MemAvailable


class LLMEngine:
    def __init__(self, config: EngineConfig, *, checkpoint=None, stat_loggers: Seq[StatLogger] = ()) -> None:
        """Load the model named by config.model (or use a loaded `checkpoint`), size the KV cache."""
        self.config = config
        # CPU: the threads every step runs on, set on whichever thread steps the engine (engine.openmp)
        self.cpu_threads = engine_threads(config.cpu_threads) if config.device_kind == "cpu" else None
        self._use_cpu_threads()
        if checkpoint is None:
            from engine.loader import load_checkpoint
            from engine.registry import resolve_model

            checkpoint = load_checkpoint(resolve_model(config.model))
        self.tokenizer = checkpoint.tokenizer
        self.model_args = getattr(checkpoint, "args", None) or read_model_args(
            checkpoint.config, getattr(checkpoint, "source", "") or "config.json")
        self.max_model_len = min(config.max_model_len or self.model_args.max_position_embeddings,
                                 self.model_args.max_position_embeddings)
        model = _build_model(self.model_args, checkpoint.weights, config)
        self.runner = ModelRunner(model, config.block_size, self.max_model_len, config.max_num_seqs,
                                  config.max_num_batched_tokens, enforce_eager=config.enforce_eager)
        self.structured = StructuredOutputs(self.tokenizer, self.model_args.vocab_size)
        self.sampler = Sampler(config.seed, self.runner.staging, self.structured)
        num_blocks = self._num_kv_blocks()
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.capture_graphs()
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.stat_loggers: list[StatLogger] = list(stat_loggers)
        self.iteration = 0
        self._finished: list[RequestOutput] = []  # finished outside a step (bad input, abort)
        self._seqs: dict[str, Sequence] = {}  # unfinished, by request id
        self._detoks: dict[int, object] = {}  # seq_index -> incremental detokenizer (stop strings only)
        self._ids = itertools.count()
        self._num_constrained = 0  # unfinished requests with a grammar
        self._in_flight: _InFlight | None = None  # a launched step whose tokens are not applied yet
        self.fault: EngineFault | None = None  # set when a step failed the engine: no step runs after it

    def _use_cpu_threads(self) -> None:
        """torch's thread count is the calling thread's own: a worker steps its engine from a thread of
        its own, a script from its main thread, and both get the engine's count."""
        if self.cpu_threads is not None and torch.get_num_threads() != self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)

    def _num_kv_blocks(self) -> int:
        """KV blocks: as configured, else what the memory budget holds, never more than every
        sequence at full length would need. Logged, and in every iteration's kv_blocks_total."""
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = kv_block_bytes(self.model_args, cfg.block_size, DTYPES[cfg.dtype])
        by_need = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)
        budget, source = self._kv_budget_bytes()
        by_memory = budget // per_block
        if by_memory < -(-self.max_model_len // cfg.block_size) and by_memory < by_need:
            log.warning("KV cache of %d blocks cannot hold one sequence of max_model_len %d (%s)",
                        by_memory, self.max_model_len, source)
        if by_memory < 1:
            raise RuntimeError(f"no memory left for the KV cache: {source}; lower max_num_batched_tokens, "
                               "raise gpu_memory_utilization or set num_kv_blocks")
        blocks = min(by_memory, by_need)
        log.info("KV cache: %d blocks of %d tokens (%.2f GiB, %s); %d would hold every sequence at "
                 "max_model_len", blocks, cfg.block_size, blocks * per_block / (1 << 30), source, by_need)
        return blocks

    def _kv_budget_bytes(self) -> tuple[int, str]:
        """Bytes the KV cache may take, and where the number came from."""
        cfg = self.config
        if cfg.device_kind == "cuda":
            budget, why = self.runner.profile_kv_budget(cfg.gpu_memory_utilization, self.sampler)
            return budget, why
        if cfg.kv_cache_memory_gb is not None:
            return int(cfg.kv_cache_memory_gb * (1 << 30)), f"kv_cache_memory_gb={cfg.kv_cache_memory_gb:g}"
        free = _available_ram()
        return int(free * CPU_FREE_RAM_SHARE), (f"{CPU_FREE_RAM_SHARE:.0%} of {free / (1 << 30):.1f} GiB "
                                                "available RAM; --kv-cache-memory sets it")

    # -- requests
    def add_request(
        self,
        request_id: str | None = None,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        *,
        messages: list[dict] | None = None,
        job_id: str | None = None,
        arrival_ts: float | None = None,
    ) -> str:
        """Queue a request (text, token ids, or chat messages). A request that cannot run finishes at
        once with finish_reason "error"; its output comes back from the next step()."""
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        params = params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        try:
            token_ids = self._prompt_token_ids(prompt, messages)
        except ValueError as exc:
            token_ids, error = [], str(exc)
        else:
            error = self._check_prompt(token_ids) or self._prepare_constraint(params)
        seq = Sequence(request_id, token_ids, params, arrival_ts=arrival_ts or time.time(),
                       prompt=text, job_id=job_id)
        if error:
            seq.finish_reason, seq.error = "error", error
            seq.stats.finished_ts = time.time()
            self._finished.append(self._output(seq))
            return request_id
        seq.stats.max_tokens = min(params.max_tokens, self.max_model_len - len(token_ids))
        seq.max_num_tokens = len(token_ids) + seq.stats.max_tokens
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None and not params.ignore_eos else ()
        seq.stop_token_ids = frozenset(eos) | frozenset(params.stop_token_ids)
        self._seqs[request_id] = seq
        self._num_constrained += params.constraint is not None
        if params.stop and self.tokenizer is not None:
            self._detoks[seq.seq_index] = self.tokenizer.detokenizer(token_ids)
        self.scheduler.add(seq)
        return request_id

    def _prompt_token_ids(self, prompt, messages) -> list[int]:
        if messages is not None:
            if self.tokenizer is None:
                raise ValueError("chat messages need a tokenizer; this model has none")
            contents = (m.get("content") for m in messages if isinstance(m, dict))
            self._check_text_length(sum(len(c) for c in contents if isinstance(c, str)))
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; this model has none (pass token ids)")
            self._check_text_length(len(prompt))
            return self.tokenizer.encode(prompt) if prompt else []
        if prompt is None:
            raise ValueError("a request needs a prompt (text or token ids) or messages")
        return [int(t) for t in prompt]

    def _check_text_length(self, chars: int) -> None:
        """Refuse, without tokenizing it, a text too long to fit max_model_len whatever its tokens: a
        tokenizer holds the GIL throughout (seconds per MB), which would starve every other thread."""
        per_token = self.tokenizer.max_token_chars
        if per_token and chars > per_token * self.max_model_len:
            raise ValueError(f"prompt has {chars} characters, so at least {-(-chars // per_token)} tokens; "
                             f"max_model_len is {self.max_model_len} (it was refused without tokenizing it)")

    def _check_prompt(self, token_ids: list[int]) -> str | None:
        if not token_ids:
            return "empty prompt"
        if len(token_ids) >= self.max_model_len:
            return (f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len} "
                    "(prompt + at least one output token must fit)")
        bad = next((t for t in token_ids if not 0 <= t < self.model_args.vocab_size), None)
        if bad is not None:
            return f"token id {bad} is outside the vocabulary [0, {self.model_args.vocab_size})"
        return None

    def _prepare_constraint(self, params: SamplingParams) -> str | None:
        """Compile the request's grammar (once per distinct constraint); the error if it is refused."""
        if params.constraint is None:
            return None
        try:
            self.structured.prepare(params.constraint)
        except ValueError as exc:
            return str(exc)
        return None

    def abort_request(self, request_ids: Seq[str]) -> None:
        """Stop requests wherever they are; their outputs (finish_reason "cancelled") come from step()."""
        for rid in request_ids:
            seq = self._seqs.get(str(rid))
            if seq is not None:
                self.scheduler.finish(seq, "cancelled")
                self._on_finished(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self._seqs) or bool(self._finished)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._seqs)

    # -- one iteration
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, apply stops. Returns the requests that finished.

        With async_scheduling (the default) a step queues its own work on the device first and only
        then waits for the tokens of the step before and applies them: the device runs step N while
        the host schedules, prepares and uploads step N+1. A sequence sampled in step N is scheduled
        in step N+1 with a placeholder token (engine.sequence.PLACEHOLDER), which the device fills
        from step N's tokens; one that step N finishes was computed once more for nothing. A step
        with penalties or grammars needs its tokens on the host before the next one can be built,
        so it is applied at once, as every step is without async_scheduling. Tokens are the same
        either way. Still one host sync per step: the wait for one step's tokens.

        Raises EngineFault when the engine itself failed (engine.faults): the device ran out of
        memory, a kernel did not compile, the device reported an error. No request is finished for
        it, and every later call raises it again: the engine's state is unknown."""
        self._use_cpu_threads()
        if self.fault is not None:
            raise self.fault
        ts, t0 = time.time(), time.perf_counter()
        self.structured.mask_fill_s = 0.0
        any_constrained = self._num_constrained > 0  # before this step finishes any
        sched = self.scheduler.schedule()
        occupancy = (len(self.scheduler.running), len(self.scheduler.waiting))
        for seq in sched.preempted:
            self.runner.release(seq)
        for seq in sched.rejected:
            self._on_finished(seq)
        for s in sched.scheduled:
            if not s.seq.stats.scheduled_ts:
                s.seq.stats.scheduled_ts = ts
        num_finished = len(sched.rejected)
        before, self._in_flight = self._in_flight, None
        launched = None
        if sched.scheduled:
            try:
                launched = self._launch(sched.scheduled, before)
            except Exception as exc:  # noqa: BLE001 - pinned on its request(s) below, or the engine's
                self._check_device_fault(exc, len(sched.scheduled))
                num_finished += self._apply(before)  # the placeholders' tokens, then the step without them
                before = None
                num_finished += self._run_isolating_faults(
                    [s for s in sched.scheduled if s.seq.status is not SequenceStatus.FINISHED], exc)
        num_finished += self._apply(before)
        if launched is not None:
            self._advance(launched)
            if self.config.async_scheduling and not launched.needs_host_tokens:
                self._in_flight = launched
            else:
                num_finished += self._apply(launched)
        self._log(sched, ts, time.perf_counter() - t0, num_finished, occupancy, any_constrained)
        finished, self._finished = self._finished, []
        return finished

    def drain(self) -> None:
        """Apply the step still in flight (asynchronous scheduling) now: every sequence's latest
        token is then on the host, as after a synchronous step. Requests it finishes come back from
        the next step()."""
        step, self._in_flight = self._in_flight, None
        self._apply(step)

    def _launch(self, scheduled: list[ScheduledSequence], before: _InFlight | None) -> _InFlight:
        """Queue a step on the device: the forward, the sampling and the copy of its tokens to the
        host; nothing is waited for. `before`: the step whose tokens are still placeholders."""
        logits, sample_seqs = self.runner.execute(SchedulerOutput(scheduled=scheduled),
                                                  None if before is None else before.sampled.tokens)
        sampled = self.sampler.sample(logits, sample_seqs)
        fetch = self.runner.staging.fetch_start(sampled.fetched)
        return _InFlight(scheduled, sample_seqs, sampled, fetch)

    def _advance(self, step: _InFlight) -> None:
        """A launched step's computed tokens count; each sampled sequence gets its placeholder."""
        self.scheduler.on_step_done(SchedulerOutput(scheduled=step.scheduled))
        finished = SequenceStatus.FINISHED
        for row, seq in enumerate(step.sample_seqs):
            if seq.status is not finished:
                seq.token_ids.append(PLACEHOLDER)
                seq.pending_row = row

    def _apply(self, step: _InFlight | None) -> int:
        """Wait for a launched step's tokens (the host sync) and put them in place of its
        placeholders: stops, lengths and grammars are checked, finished requests leave. A sequence
        finished meanwhile (a stop in the step before, an abort) drops its token. Returns how many
        finished."""
        if step is None:
            return 0
        try:
            tokens, logprobs = self.sampler.collect(step.sampled, self.runner.staging.fetch_wait(step.fetch))
        except Exception as exc:  # noqa: BLE001 - as a failed step: the device's fault, or these requests'
            self._check_device_fault(exc, len(step.scheduled))
            return self._fail([s for s in step.scheduled if s.seq.status is not SequenceStatus.FINISHED], exc)
        now, num_finished, finished = time.time(), 0, SequenceStatus.FINISHED
        for seq, token, lp in zip(step.sample_seqs, tokens, logprobs, strict=True):
            if seq.status is finished:
                continue
            seq.token_ids[-1] = token
            seq.pending_row = None
            # the common case, decided on counters: no stop, no grammar, no stop strings, no logprobs
            if seq.plain and lp is None and token not in seq.stop_token_ids \
                    and len(seq.token_ids) < seq.max_num_tokens and seq.stats.first_token_ts:
                continue
            try:
                num_finished += self._append_token(seq, token, lp, now)
            except Exception as exc:  # noqa: BLE001 - e.g. a stop-string check on odd bytes
                num_finished += self._fail([ScheduledSequence(seq, 0, False)], exc)
        return num_finished

    def _check_device_fault(self, exc: Exception, num_requests: int) -> None:
        """Raise EngineFault for a device fault: no request's doing, and halving the step would only
        make error rows of all its requests."""
        if is_device_fault(exc):
            self.fault = EngineFault.from_exception(exc)
            log.error("engine step over %d requests failed the engine: %s", num_requests, self.fault.reason,
                      exc_info=exc)
            raise self.fault from exc

    def _run_isolating_faults(self, scheduled: list[ScheduledSequence], exc: Exception) -> int:
        """A step that raised `exc` is run again in halves, down to single requests: only the
        request(s) that fail alone are lost, nothing else (recomputing a piece rewrites the same KV
        slots, and nothing advances until a piece succeeds; the staging buffers wait for the failed
        piece's uploads before they are written again). Each piece that runs is applied at once. A
        device fault is not halved: it raises EngineFault at once (engine.faults). Returns how many
        requests finished."""
        if len(scheduled) <= 1:
            return self._fail(scheduled, exc) if scheduled else 0
        log.warning("engine step over %d requests failed (%r); isolating the request(s) at fault",
                    len(scheduled), exc)
        num_finished, pieces = 0, [scheduled[: len(scheduled) // 2], scheduled[len(scheduled) // 2:]]
        while pieces:
            piece = pieces.pop(0)
            try:
                step = self._launch(piece, None)
            except Exception as piece_exc:  # noqa: BLE001 - halved again below
                self._check_device_fault(piece_exc, len(piece))
                if len(piece) == 1:
                    num_finished += self._fail(piece, piece_exc)
                else:
                    pieces[:0] = [piece[: len(piece) // 2], piece[len(piece) // 2:]]
                continue
            self._advance(step)
            num_finished += self._apply(step)
        return num_finished

    def _fail(self, piece: list[ScheduledSequence], exc: Exception) -> int:
        """Finish the request whose step fails on its own with finish_reason "error"."""
        for s in piece:
            log.warning("request %s failed in the engine step and is finished with an error: %r",
                        s.seq.request_id, exc, exc_info=exc)
            self.scheduler.finish(s.seq, "error", f"engine step failed for this request: {exc!r}")
            self._on_finished(s.seq)
        return len(piece)

    def _append_token(self, seq: Sequence, token: int, logprobs, now: float) -> int:
        """Checks on a sequence's new token (already its latest): stops, lengths, its grammar."""
        if not seq.stats.first_token_ts:
            seq.stats.first_token_ts = now
        if logprobs is not None:
            seq.logprobs = seq.logprobs or []
            seq.logprobs.append(logprobs)
        reason = self._grammar_stop(seq, token) or self._stop_reason(seq, token)
        if reason is None:
            return 0
        if reason == "length" and seq.params.constraint is not None:
            if self.structured.is_completed(seq):  # whole and valid on its last allowed token
                reason = "stop"
            else:
                limit = "max_tokens" if seq.num_output_tokens >= seq.params.max_tokens else "max_model_len"
                seq.error = (f"{limit} reached before the {seq.params.constraint.describe()} output was "
                             "complete: the output is incomplete")
        self.scheduler.finish(seq, reason, seq.error)
        self._on_finished(seq)
        return 1

    def _grammar_stop(self, seq: Sequence, token: int) -> str | None:
        """Advance a constrained sequence's grammar by its new token: "stop" once the grammar is
        complete, "error" (with seq.error) if it refuses the token."""
        constraint = seq.params.constraint
        if constraint is None:
            return None
        if not self.structured.accept(seq, token):
            seq.error = f"token {token} does not match the {constraint.describe()} grammar"
            return "error"
        return "stop" if self.structured.is_terminated(seq) else None

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        if token in seq.stop_token_ids:
            return "stop"
        if self._detoks:
            detok = self._detoks.get(seq.seq_index)
            if detok is not None:
                detok.add(token)
                text = detok.text
                cut = min((i for i in (text.find(s) for s in seq.params.stop) if i >= 0), default=-1)
                if cut >= 0:
                    seq.stop_text = text[:cut]
                    return "stop"
        if len(seq.token_ids) >= seq.max_num_tokens:  # max_tokens, or max_model_len (stats.max_tokens)
            return "length"
        return None

    def _on_finished(self, seq: Sequence) -> None:
        if seq.pending_row is not None:  # finished while its latest token was being sampled: dropped
            seq.token_ids.pop()
            seq.pending_row = None
        seq.stats.finished_ts = time.time()
        if self._seqs.pop(seq.request_id, None) is not None:
            self._num_constrained -= seq.params.constraint is not None
        self.runner.release(seq)
        self.sampler.release(seq)
        self.structured.release(seq)
        self._finished.append(self._output(seq))
        self._detoks.pop(seq.seq_index, None)

    def _output(self, seq: Sequence) -> RequestOutput:
        out_ids = seq.output_token_ids
        text = seq.stop_text
        if text is None:
            text = self._decode_output(seq, out_ids)
        seq.stats.output_tokens = len(out_ids)
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
            text=text, token_ids=out_ids, finished=True, finish_reason=seq.finish_reason,
            error=seq.error, logprobs=seq.logprobs, metrics=seq.stats, job_id=seq.job_id,
        )

    def _decode_output(self, seq: Sequence, out_ids: list[int]) -> str:
        if self.tokenizer is None or not out_ids:
            return ""
        eos = self.tokenizer.eos_token_ids
        if seq.finish_reason == "stop" and out_ids[-1] in eos | set(seq.params.stop_token_ids):
            out_ids = out_ids[:-1]  # the stop token itself is not text
        return self.tokenizer.decode(out_ids)

    def _log(self, sched: SchedulerOutput, ts: float, duration: float, num_finished: int,
             occupancy: tuple[int, int], any_constrained: bool) -> None:
        if not self.stat_loggers:
            self.iteration += 1
            return
        scheduled = sched.scheduled
        decode_tokens = sum(map(_IS_DECODE, scheduled))
        scheduled_tokens = sched.num_scheduled_tokens
        stats = IterationStats(
            iteration=self.iteration, ts=ts, duration_s=duration,
            num_running=occupancy[0], num_waiting=occupancy[1],
            num_scheduled_seqs=len(scheduled), num_prefill_seqs=len(scheduled) - decode_tokens,
            num_decode_seqs=decode_tokens, prefill_tokens=scheduled_tokens - decode_tokens,
            decode_tokens=decode_tokens, scheduled_tokens=scheduled_tokens,
            token_budget=self.config.max_num_batched_tokens, max_num_seqs=self.config.max_num_seqs,
            kv_blocks_used=self.block_manager.num_used_blocks, kv_blocks_total=self.block_manager.num_blocks,
            num_preempted=len(sched.preempted), num_finished=num_finished,
            prefix_cache_hit_tokens=sched.prefix_cache_hit_tokens,
            job_ids=sorted(set(map(_JOB_ID, map(_SEQ, scheduled))) - {None}),
            num_constrained_seqs=(sum(s.seq.params.constraint is not None for s in scheduled)
                                  if any_constrained else 0),
            mask_fill_s=self.structured.mask_fill_s,
        )
        self.iteration += 1
        for logger in self.stat_loggers:
            logger(stats)


@dataclass
class _InFlight:
    """A step queued on the device whose tokens the host has not applied yet."""

    scheduled: list[ScheduledSequence]
    sample_seqs: list[Sequence]
    sampled: Sampled
    fetch: object  # engine.staging's handle of the tokens' copy to the host

    @property
    def needs_host_tokens(self) -> bool:
        """Whether the next step can only be built from this one's tokens on the host: penalties
        count the output tokens, a grammar's mask follows the tokens accepted."""
        return any(map(_NEEDS_HOST_TOKENS, self.sample_seqs))


def _available_ram() -> int:
    """MemAvailable from /proc/meminfo (bytes); the physical memory where that file is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _build_model(args: ModelArgs, weights: dict[str, torch.Tensor], config: EngineConfig) -> Transformer:
    if config.kernel_options is not None:  # before the weights are packed: they pick the GEMM paths too
        from kernels import ops

        ops.configure(config.kernel_options)
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"--device {config.device}: CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise RuntimeError(f"--device {config.device}: this machine has {torch.cuda.device_count()} CUDA "
                           "device(s)")
    with torch.device("meta"):
        model = Transformer(args).to(DTYPES[config.dtype])  # allocated once, in the dtype it runs in
    model = model.to_empty(device=device)
    model.load_hf_weights(weights)
    return model.eval()
