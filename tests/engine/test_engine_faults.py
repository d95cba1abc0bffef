"""A request whose step raises fails alone: the engine re-runs the step in halves down to the
request at fault, finishes it with finish_reason 'error', and everyone else gets the tokens a clean
run gives."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.engine.tiny import tiny_hf_checkpoint

CONFIG = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_kv_blocks=96)


@pytest.fixture(scope="module")
def ckpt():
    return tiny_hf_checkpoint(seed=2)


def _prompts(n, seed=0, vocab=90):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 30))] for _ in range(n)]


def _poison(llm, token: int) -> None:
    """Make the model raise whenever `token` is among its input ids (a stand-in for a request that
    breaks a kernel: an out-of-range value, a shape the kernel refuses)."""
    model = llm.engine.runner.model
    real = model.forward

    def forward(input_ids, *args, **kwargs):
        if bool((input_ids == token).any()):
            raise RuntimeError(f"kernel refused token {token}")
        return real(input_ids, *args, **kwargs)

    model.forward = forward


@pytest.mark.parametrize("eager", [True, False])
def test_the_request_at_fault_fails_alone(ckpt, eager):
    prompts = _prompts(12, seed=1)
    params = [SamplingParams(max_tokens=8, temperature=0.0) if i % 2 else
              SamplingParams(max_tokens=8, temperature=0.9, seed=i) for i in range(len(prompts))]
    clean = [o.token_ids for o in LLM("tiny", checkpoint=ckpt, enforce_eager=eager, **CONFIG)
             .generate(prompts, params)]
    poison = 95  # outside every prompt (ids < 90)
    assert all(poison not in toks for toks in clean)
    prompts[5] = prompts[5][:3] + [poison] + prompts[5][3:]
    llm = LLM("tiny", checkpoint=ckpt, enforce_eager=eager, **CONFIG)
    _poison(llm, poison)
    outs = llm.generate(prompts, params)
    assert outs[5].finish_reason == "error" and "kernel refused token 95" in outs[5].error
    for i, out in enumerate(outs):
        if i != 5:
            assert out.finish_reason == "length" and out.token_ids == clean[i], i
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert sum(s.num_finished for s in llm.iteration_stats) == len(prompts)


def test_a_failure_in_the_stop_check_fails_only_its_request(ckpt, monkeypatch):
    llm = LLM("tiny", checkpoint=ckpt, **CONFIG)
    engine = llm.engine
    real = engine._stop_reason

    def stop_reason(seq, token):
        if seq.request_id == "bad":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real(seq, token)

    monkeypatch.setattr(engine, "_stop_reason", stop_reason)
    engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
    engine.add_request("good", [4, 5, 6], SamplingParams(max_tokens=4, temperature=0.0))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step()})
    assert done["bad"].finish_reason == "error" and "invalid start byte" in done["bad"].error
    assert done["good"].finish_reason == "length" and len(done["good"].token_ids) == 4
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def _device_faults():
    """What a GPU (or the CPU's native kernels, or Triton) raises when the engine, not a request,
    fails: each must stop the engine, never become error rows."""
    import torch
    from triton.runtime.errors import OutOfResources

    return {
        "cuda-oom": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        "sticky": torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
        "sticky-text": RuntimeError("CUDA error: device-side assert triggered"),
        "triton-resources": OutOfResources(262144, 232448, "shared memory"),
        "host-oom": MemoryError(),
        "native-kernel": RuntimeError("native paged attention failed: out of memory"),
    }


@pytest.mark.parametrize("kind", list(_device_faults()))
def test_a_device_fault_stops_the_engine_instead_of_making_error_rows(ckpt, kind):
    """No halving, no error rows: the step raises EngineFault at its first failure, and so does every
    later step (the engine's state is unknown). A worker hands the shards back (tests/jobs)."""
    from engine.faults import EngineFault

    llm = LLM("tiny", checkpoint=ckpt, **CONFIG)
    engine, exc = llm.engine, _device_faults()[kind]
    for i, prompt in enumerate(_prompts(6, seed=4)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=8, temperature=0.0))
    assert engine.step() == [] and engine.step() == []  # two good steps first
    calls = []

    def forward(*args, **kwargs):
        calls.append(1)
        raise exc

    engine.runner.model.forward = forward
    with pytest.raises(EngineFault) as caught:
        engine.step()
    assert calls == [1]  # the step was not re-run in halves
    assert caught.value.__cause__ is exc and type(exc).__name__ in caught.value.reason
    with pytest.raises(EngineFault):
        engine.step()
    assert calls == [1] and engine.num_unfinished_requests == 6  # nothing finished, nothing ran again


def test_a_request_fault_still_fails_only_its_request(ckpt):
    """A ValueError from one request's input (here: a token the model refuses) is a request's fault:
    one error row, and the engine goes on."""
    llm = LLM("tiny", checkpoint=ckpt, **CONFIG)
    model = llm.engine.runner.model
    real = model.forward

    def forward(input_ids, *args, **kwargs):
        if bool((input_ids == 95).any()):
            raise ValueError("token 95: no such row in this request's lookup table")
        return real(input_ids, *args, **kwargs)

    model.forward = forward
    outs = llm.generate([[1, 2, 95], [3, 4, 5], [6, 7]], SamplingParams(max_tokens=4, temperature=0.0))
    assert [o.finish_reason for o in outs] == ["error", "length", "length"]
    assert "no such row" in outs[0].error


class _StagingLog:
    """Records the staging buffers' writes, uploads and waits in order, with uploads made real on the
    CPU (host and device tensors are one there, so nothing is ever in flight otherwise)."""

    def __init__(self, staging):
        self.events: list[tuple[str, str]] = []
        staging.separate = True  # uploads are now "asynchronous copies" the staging must wait for
        buffer, upload, wait = staging.buffer, staging.upload, staging.wait

        def logged_buffer(name, *args):
            out = buffer(name, *args)  # waits first where needed
            self.events.append(("write", name))
            return out

        def logged_upload(name, n):
            self.events.append(("upload", name))
            return upload(name, n)

        def logged_wait():
            self.events.append(("wait", ""))
            wait()

        staging.buffer, staging.upload, staging.wait = logged_buffer, logged_upload, logged_wait
        fetch = staging.fetch
        staging.fetch = lambda x: (self.events.append(("wait", "fetch")), fetch(x))[1]

    def writes_over_copies_in_flight(self) -> list[int]:
        """Indices of writes to a buffer whose upload no wait (nor fetch) followed."""
        in_flight, bad = set(), []
        for i, (what, name) in enumerate(self.events):
            if what == "upload":
                in_flight.add(name)
            elif what == "wait":
                in_flight.clear()
            elif name in in_flight:
                bad.append(i)
        return bad


def test_re_runs_after_a_failed_step_wait_for_its_uploads_before_rewriting_them(ckpt):
    """A step that fails after uploading its inputs never reaches its fetch (the step's one wait);
    the halves re-run at once and rewrite the same pinned buffers: they must wait first, or a copy
    still in flight would read the halves' values (engine/staging.py)."""
    llm = LLM("tiny", checkpoint=ckpt, **CONFIG)
    _poison(llm, 95)
    log = _StagingLog(llm.engine.runner.staging)
    prompts = _prompts(8, seed=5)
    prompts[3] = prompts[3] + [95]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
    assert [o.finish_reason for o in outs].count("error") == 1
    assert log.writes_over_copies_in_flight() == []
    waits = sum(1 for what, name in log.events if what == "wait" and name != "fetch")
    assert waits > 0  # the re-runs waited (a clean step's fetch is its only wait)
