"""The GPU path's promises, checked on the CPU with stand-ins that fail for the reasons a GPU would:

- a step reads the device once (the sampled tokens), the model's forward included: run on a pretend
  device that records every device -> host read (tests/engine/device_standin.py), and shown to
  catch each kind of read when one is added to the step or to the forward;
- a CUDA graph's replay gives the eager tokens: a replay re-reads the static device buffers but keeps
  every host-side value of its capture (context lengths all 1), emulated here for each backend;
  a backend whose replay is wrong is refused graphs on CUDA;
- the KV budget for --gpu-memory-utilization counts the graphs' memory and what the process holds.
"""

from __future__ import annotations

import io
import random
from collections import Counter

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model_runner import DeviceMemory, graphs_refused, kv_budget
from kernels import ops
from tests.engine.device_standin import fake_device_model, on_device, on_fake_device
from tests.engine.tiny import tiny_hf_checkpoint

CONFIG = dict(max_num_seqs=6, max_num_batched_tokens=48, block_size=4, num_kv_blocks=160)
FETCH = ("copy_ to host", "engine/staging.py")  # the step's one read: Staging.fetch


@pytest.fixture(scope="module")
def ckpt():
    return tiny_hf_checkpoint(seed=4)


@pytest.fixture
def backend():
    yield ops.set_backend
    ops.set_backend(None)


def _requests(n: int, seed: int = 0, long_every: int = 0):
    """Prompts (some long, so decode contexts differ a lot) and mixed sampling: greedy, seeded top-k /
    top-p / min-p, penalties, logprobs."""
    rng = random.Random(seed)
    lengths = [200 if long_every and i % long_every == 0 else rng.randint(2, 20) for i in range(n)]
    prompts = [[rng.randrange(90) for _ in range(length)] for length in lengths]
    kinds = [SamplingParams(max_tokens=5, temperature=0.0),
             SamplingParams(max_tokens=6, temperature=0.8, top_k=12, top_p=0.9, seed=7),
             SamplingParams(max_tokens=4, temperature=1.1, min_p=0.05, presence_penalty=0.4,
                            repetition_penalty=1.2, seed=9, logprobs=2)]
    return prompts, [kinds[i % len(kinds)] for i in range(n)]


def _overlappable(prompts, params):
    """The requests with the penalties' kind swapped for seeded sampling with logprobs: steps the
    asynchronous path overlaps (penalties need the tokens on the host before the next step)."""
    other = SamplingParams(max_tokens=7, temperature=0.9, top_p=0.8, seed=3, logprobs=2)
    return prompts, [other if p.has_penalties else p for p in params]


def _fake_device_llm(ckpt, monkeypatch, **config) -> LLM:
    monkeypatch.setattr("engine.llm_engine._build_model", fake_device_model)
    llm = LLM("tiny", checkpoint=ckpt, **{**CONFIG, **config})
    runner = llm.engine.runner
    assert runner.device == torch.device("meta")
    assert on_device(runner.model.embed_tokens.weight, runner.block_tables, *runner.kv_caches[0],
                     runner.staging.device_buffer("step"))
    return llm


def _reads_per_step(llm: LLM, reads, prompts, params) -> list[list[tuple[str, str]]]:
    """Generate, recording the reads of each engine step separately."""
    engine, per_step = llm.engine, []
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    while engine.has_unfinished_requests():
        start = len(reads.events)
        engine.step()
        per_step.append([(what, where.rpartition(":")[0]) for what, where in reads.since(start)])
    return per_step


def _count_waits(llm: LLM) -> list[int]:
    """Counts the waits for fetched tokens (a host sync each) into the list returned."""
    staging, waits = llm.engine.runner.staging, [0]
    real = staging.fetch_wait
    staging.fetch_wait = lambda fetch: (waits.__setitem__(0, waits[0] + 1), real(fetch))[1]
    return waits


@pytest.mark.parametrize("name,eager,async_scheduling", [
    ("torch", True, True), ("torch", False, True), ("triton", False, True), ("torch", False, False)])
def test_a_step_reads_the_device_once(ckpt, monkeypatch, backend, name, eager, async_scheduling):
    """Every device -> host read of a step is recorded, the forward's included: one per step that
    runs anything, the sampled tokens' fetch, waited for once. (The old check counted syncing aten
    ops outside the forward and missed a `.tolist()`, a `.cpu().numpy()` and an `.item()` in the
    forward.) With asynchronous scheduling the last step only applies the tokens of the one before."""
    backend(name)
    with on_fake_device() as reads:
        llm = _fake_device_llm(ckpt, monkeypatch, enforce_eager=eager, async_scheduling=async_scheduling)
        prompts, params = _overlappable(*_requests(7 if name == "torch" else 3,
                                                   long_every=3 if name == "torch" else 0))
        fetches = llm.engine.runner.staging.num_fetches
        waits = _count_waits(llm)
        per_step = _reads_per_step(llm, reads, prompts, params)
    ran = [s.num_scheduled_seqs > 0 for s in llm.iteration_stats]
    assert all(reads == [FETCH] * r for reads, r in zip(per_step, ran, strict=True)), \
        Counter(r for step in per_step for r in step)
    assert llm.engine.runner.staging.num_fetches - fetches == waits[0] == sum(ran) > 5
    assert sum(ran) == len(per_step) - async_scheduling


def test_the_next_step_is_queued_before_the_host_waits_for_the_tokens(ckpt, monkeypatch):
    """Asynchronous scheduling: in a run of decode steps, the forward of step N+1 is called (its
    inputs prepared and uploaded, its work queued) before the host waits for step N's tokens; the
    step's wait and its copy stay one each (above). Without it, each step waits for its own."""
    order = {}
    for async_scheduling in (True, False):
        llm = LLM("tiny", checkpoint=ckpt, **{**CONFIG, "async_scheduling": async_scheduling})
        events, staging, model = [], llm.engine.runner.staging, llm.engine.runner.model
        real_wait, real_forward = staging.fetch_wait, model.forward
        staging.fetch_wait = lambda fetch, ev=events, w=real_wait: (ev.append("wait"), w(fetch))[1]
        model.forward = lambda *a, ev=events, f=real_forward, **k: (ev.append("forward"), f(*a, **k))[1]
        llm.generate(*_overlappable(*_requests(4)))
        order[async_scheduling] = "".join("F" if e == "forward" else "w" for e in events)
    assert order[False] == "Fw" * (len(order[False]) // 2)
    assert order[True].startswith("FFwFw") and order[True].endswith("Fww")
    assert order[True].count("F") == order[True].count("w")


READS = {
    "item": lambda t: t.sum().item(),
    "tolist": lambda t: t[:2].tolist(),
    "cpu": lambda t: t.cpu(),
    "numpy": lambda t: t.numpy(),
    "print": lambda t: print(t, file=io.StringIO()),
    "bool": lambda t: bool((t > 0).any()),
    "boolean index": lambda t: t[t > 0],
}


@pytest.mark.parametrize("read", list(READS))
@pytest.mark.parametrize("where", ["forward", "step"])
def test_the_stand_in_catches_a_read_added_to_the_forward_or_the_step(ckpt, monkeypatch, backend, read,
                                                                      where):
    """The check above fails for the right reason: each kind of read, added to a decoder layer (the
    forward) or to the runner's head (the step, after the forward), is recorded."""
    backend("torch")
    with on_fake_device() as reads:
        llm = _fake_device_llm(ckpt, monkeypatch)
        runner = llm.engine.runner
        if where == "forward":
            mlp = runner.model.layers[1].mlp
            real = mlp.forward
            monkeypatch.setattr(mlp, "forward", lambda x: (READS[read](x), real(x))[1])
        else:
            real = runner._head
            monkeypatch.setattr(runner, "_head",
                                lambda hidden, seqs: (READS[read](hidden), real(hidden, seqs))[1])
        per_step = _reads_per_step(llm, reads, *_requests(2))
    extra = [r for step in per_step for r in step if r != FETCH]
    ran = sum(s.num_scheduled_seqs > 0 for s in llm.iteration_stats)  # async: the last step only applies
    assert len(extra) >= ran >= len(per_step) - 1, (read, where, per_step)


# -- CUDA graphs: a replay keeps the host-side values of its capture


class _EmulatedGraph:
    """torch.cuda.CUDAGraph for one decode bucket, on the CPU. `capture` runs the bucket's forward
    over its padding inputs as ModelRunner._capture does (every host-side context length 1) and
    keeps the output tensor; `replay` runs that forward again over whatever the static device
    buffers hold now, with the capture's host-side values, into the same output: a graph's replay
    re-reads device memory and repeats the capture's kernels with their capture-time arguments."""

    def __init__(self, runner, size: int) -> None:
        self.runner, self.size = runner, size
        runner._stage_padding(size)
        self.out = runner._decode_forward(size, [1] * size)

    def replay(self) -> None:
        self.out.copy_(self.runner._decode_forward(self.size, [1] * self.size))


def _with_emulated_graphs(llm: LLM) -> None:
    """Decode steps padded to their bucket and replayed, as ModelRunner runs them on CUDA."""
    runner = llm.engine.runner
    runner.pad_decodes = True
    with torch.inference_mode():
        for size in runner.buckets:
            graph = _EmulatedGraph(runner, size)
            runner.graphs[size] = (graph, graph.out)


def _generate(llm: LLM, prompts, params):
    return [(o.token_ids, o.finish_reason, o.logprobs) for o in llm.generate(prompts, params)]


# whether a replay with capture-time host values is right: the Triton and native kernels read the
# context lengths from device memory; the torch references plan their gathers from the host lengths
REPLAY_SAFE = {"triton": True, "cpu-native": True, "torch": False}


@pytest.mark.parametrize("name", list(REPLAY_SAFE))
def test_graph_replays_give_the_eager_tokens_or_the_backend_gets_no_graphs(ckpt, backend, name):
    backend(name)
    prompts, params = _requests(4 if name == "triton" else 9, seed=2)
    eager = _generate(LLM("tiny", checkpoint=ckpt, enforce_eager=True, **CONFIG), prompts, params)
    llm = LLM("tiny", checkpoint=ckpt, **CONFIG)
    _with_emulated_graphs(llm)
    replayed = _generate(llm, prompts, params)
    assert sum(s.num_decode_seqs > 0 and s.num_prefill_seqs == 0 for s in llm.iteration_stats) > 3
    differ = sum(a != b for a, b in zip(eager, replayed, strict=True))
    if REPLAY_SAFE[name]:
        assert differ == 0
        assert graphs_refused(torch.device("cuda:0"), name) is None or name == "cpu-native"
    else:  # the emulation sees what a GPU would do with them (every request differs) ...
        assert differ == len(prompts)
        assert "host-side context lengths" in graphs_refused(torch.device("cuda:0"), name)  # ... so: none


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_the_runner_on_cuda_takes_graphs_only_where_replays_are_right(ckpt, backend, monkeypatch, name):
    """ModelRunner asks graphs_refused with its device; here the CPU runner is told it is on CUDA."""
    import engine.model_runner as model_runner

    real = model_runner.graphs_refused
    monkeypatch.setattr(model_runner, "graphs_refused", lambda device, b: real(torch.device("cuda:0"), b))
    backend(name)
    runner = LLM("tiny", checkpoint=ckpt, **CONFIG).engine.runner
    assert (runner.buckets == []) == (name == "torch")
    assert graphs_refused(torch.device("cpu"), "torch") is None  # on the CPU nothing is captured anyway


# -- the KV budget on a GPU


def test_the_kv_budget_leaves_room_for_weights_activations_graphs_and_other_processes():
    gib = 1 << 30
    memory = DeviceMemory(total=100 * gib, held=3 * gib, activation_peak=2 * gib, graphs=1 * gib,
                          outside=gib // 2)
    budget, why = kv_budget(memory, 0.9)
    assert budget == 90 * gib - 3 * gib - 2 * gib - gib - gib // 2
    assert "3.00 GiB held" in why and "1.00 GiB for CUDA graphs" in why and "0.50 GiB outside" in why


class _FakeCudaMemory:
    """torch.cuda's memory counters for a runner on the CPU: what the profile reads, scripted."""

    def __init__(self, monkeypatch, runner, total: int, held: int, peak: int, graph_pool: int) -> None:
        self.reserved, self.captures = held, []
        counters = {"empty_cache": lambda *a: None, "reset_peak_memory_stats": lambda *a: None,
                    "synchronize": lambda *a: None, "memory_allocated": lambda *a: held,
                    "max_memory_allocated": lambda *a: peak, "memory_reserved": lambda *a: self.reserved,
                    "mem_get_info": lambda *a: (total - self.reserved - (1 << 20), total)}
        for name, fn in counters.items():
            monkeypatch.setattr(torch.cuda, name, fn)

        def capture(size, pool):  # a graph's pool is reserved memory, held while the graph lives
            self.captures.append((size, len(runner.kv_caches)))
            self.reserved += graph_pool
            return object(), None

        monkeypatch.setattr(runner, "_capture", capture)


def test_profile_kv_budget_measures_the_decode_graphs_before_the_kv_cache_is_sized(ckpt, monkeypatch):
    """The largest bucket is captured over the profile's scratch KV cache (before the real cache
    exists), and the budget leaves room for it plus every smaller bucket's (S, V) float32 logits."""
    llm = LLM("tiny", checkpoint=ckpt, **CONFIG)
    runner, sampler = llm.engine.runner, llm.engine.sampler
    kv = runner.kv_caches
    mb = 1 << 20
    memory = _FakeCudaMemory(monkeypatch, runner, total=1000 * mb, held=100 * mb, peak=160 * mb,
                             graph_pool=30 * mb)
    budget, why = runner.profile_kv_budget(0.5, sampler)
    assert memory.captures == [(max(runner.buckets), 2)]  # the largest bucket, over a scratch cache
    vocab, largest = runner.args.vocab_size, max(runner.buckets)
    graphs = int((30 * mb + sum(b * vocab * 4 for b in runner.buckets if b != largest)) * 1.1)
    assert runner.graph_memory_estimate == graphs
    assert budget == 500 * mb - 100 * mb - 60 * mb - graphs - 1 * mb
    assert "for CUDA graphs" in why
    runner.kv_caches = kv
