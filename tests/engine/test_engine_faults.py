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
    CPU (host and device tensors are one there, so nothing is ever in flight otherwise). A buffer is
    its host array (engine/staging.py: two per buffer, used by alternate steps)."""

    def __init__(self, staging):
        self.events: list[tuple] = []
        staging.separate = True  # uploads are now "asynchronous copies" the staging must wait for
        buffer, upload, wait = staging.buffer, staging.upload, staging.wait
        fetch_start, fetch_wait, self.starts = staging.fetch_start, staging.fetch_wait, {}

        def logged_buffer(name, *args):
            out = buffer(name, *args)  # waits first where needed
            self.events.append(("write", staging._key(name)))
            return out

        def logged_upload(name, n):
            self.events.append(("upload", staging._key(name), len(self.events)))
            return upload(name, n)

        def logged_wait():
            self.events.append(("wait", None))
            wait()

        def logged_fetch_start(x):  # the copy is queued behind every upload so far ...
            fetch = fetch_start(x)
            self.starts[id(fetch)] = len(self.events)
            return fetch

        def logged_fetch_wait(fetch):  # ... so they have all landed once it has
            self.events.append(("landed", self.starts.pop(id(fetch))))
            return fetch_wait(fetch)

        staging.buffer, staging.upload, staging.wait = logged_buffer, logged_upload, logged_wait
        staging.fetch_start, staging.fetch_wait = logged_fetch_start, logged_fetch_wait

    def writes_over_copies_in_flight(self) -> list[int]:
        """Indices of writes to a host array whose upload has not been seen to land."""
        in_flight, bad = {}, []
        for i, event in enumerate(self.events):
            if event[0] == "upload":
                in_flight[event[1]] = event[2]
            elif event[0] == "wait":
                in_flight.clear()
            elif event[0] == "landed":
                in_flight = {k: e for k, e in in_flight.items() if e > event[1]}
            elif event[1] in in_flight:
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
    waits = sum(1 for event in log.events if event[0] == "wait")
    assert waits > 0  # the re-runs waited (a clean step's fetch is its only wait)


def test_asynchronous_steps_write_the_other_host_arrays_and_never_wait_for_uploads(ckpt):
    """With asynchronous scheduling step N+1 writes its inputs while step N's uploads may be queued:
    each buffer has two host arrays, used by alternate steps, so a clean run never waits before a
    write (the fetch is each step's only sync). With one array per buffer the same run would have to
    wait before nearly every step's writes (or, without the wait, overwrite copies in flight)."""
    waits = {}
    for arrays in (2, 1):
        llm = LLM("tiny", checkpoint=ckpt, **CONFIG)
        staging = llm.engine.runner.staging
        log = _StagingLog(staging)
        if arrays == 1:
            staging._key = lambda name: (name, 0)
        llm.generate(_prompts(8, seed=6), SamplingParams(max_tokens=6, temperature=0.7, seed=2))
        assert log.writes_over_copies_in_flight() == []
        waits[arrays] = staging.num_waits
    assert waits[2] == 0 and waits[1] > 5
