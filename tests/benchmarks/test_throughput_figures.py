"""The bench's figures themselves (37.6, 37.4): MFU counts the lm_head only for the rows whose logits
are computed, a ratio over rounds is given as the median beside the fastest, and the machine is
named from /proc/cpuinfo."""

from __future__ import annotations

import pytest

from benchmarks.machine import describe, machine_info
from benchmarks.throughput import BenchResult, Workload, _model_flops, ratios, request_flops
from engine.model import PRESETS

SMOLLM2 = PRESETS["smollm2-135m"]


def _by_hand(args, prompt_len: int, output_len: int) -> float:
    """The same count written out over the model's shapes, token by token."""
    qkv = args.dim * (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
    attn_out = args.n_heads * args.head_dim * args.dim
    mlp = 3 * args.dim * args.intermediate_size
    total = 0.0
    for position in range(prompt_len + output_len - 1):  # the last sampled token is never fed back
        keys = position + 1
        total += args.n_layers * (2 * (qkv + attn_out + mlp) + 4 * args.n_heads * args.head_dim * keys)
    return total + output_len * 2 * args.dim * args.vocab_size  # one logits row per sampled token


@pytest.mark.parametrize("prompt_len, output_len", [(1, 1), (7, 1), (64, 128), (256, 64)])
def test_request_flops_counts_the_lm_head_once_per_sampled_token(prompt_len, output_len):
    assert request_flops(SMOLLM2, prompt_len, output_len) == pytest.approx(_by_hand(SMOLLM2, prompt_len,
                                                                                    output_len), rel=1e-12)


def test_a_longer_prompt_adds_no_lm_head():
    head = 2 * SMOLLM2.dim * SMOLLM2.vocab_size
    more_prompt = request_flops(SMOLLM2, 101, 10) - request_flops(SMOLLM2, 100, 10)
    more_output = request_flops(SMOLLM2, 100, 11) - request_flops(SMOLLM2, 100, 10)
    assert more_output - more_prompt == pytest.approx(head)  # one more row of logits, same layers


def test_counting_the_lm_head_for_every_prompt_token_overstated_mfu_by_12_to_16_percent():
    """The README's workload (prompts 64-256, outputs 64-192): the old count, every processed token
    through the lm_head, against this one."""
    prompts = [[0] * n for n in (64, 128, 256, 160)]
    workload = Workload(0, prompts, [64, 192, 128, 100])
    old = sum((len(p) + o) * SMOLLM2.flops_per_token(context_len=(len(p) + o) // 2)
              for p, o in zip(workload.prompts, workload.output_lens, strict=True))
    assert 1.10 < old / _model_flops(SMOLLM2, workload) < 1.17
    # a request that ended early (a grammar's end) is counted at the tokens it produced
    assert _model_flops(SMOLLM2, workload, [1, 1, 1, 1]) < _model_flops(SMOLLM2, workload)


def _runs(*tokens_per_s: float) -> list[BenchResult]:
    return [BenchResult("x", 1.0, 1, 1, int(t), t, t, 0.0) for t in tokens_per_s]


def test_ratios_give_the_median_round_beside_the_fastest():
    """The AVX2 case from issue 37: fastest-of-two 1.10x while the rounds were 0.98x and 1.10x."""
    got = ratios(_runs(98.0, 121.0, 110.0), _runs(100.0, 110.0, 100.0))
    assert got["rounds"] == pytest.approx([0.98, 1.1, 1.1])
    assert got["median"] == pytest.approx(1.1) and got["fastest"] == pytest.approx(1.1)
    got = ratios(_runs(98.0, 110.0), _runs(100.0, 100.0))
    assert got["median"] == pytest.approx(1.04) and got["fastest"] == pytest.approx(1.1)
    lopsided = ratios(_runs(130.0, 90.0, 91.0), _runs(100.0, 100.0, 100.0))
    assert lopsided["fastest"] == pytest.approx(1.3) and lopsided["median"] == pytest.approx(0.91)


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13 64-Core Processor
flags\t\t: fpu sse4_2 avx fma avx2 f16c bmi2

processor\t: 1
model name\t: ignored
flags\t\t: ignored
"""


def test_the_machine_is_named_with_its_model_and_isa_flags():
    info = machine_info(cpuinfo=CPUINFO)
    assert info["cpu_model"] == "AMD EPYC 7B13 64-Core Processor"
    assert info["isa_flags"] == ["sse4_2", "avx", "avx2", "fma", "f16c"]
    assert info["flags"] == sorted(["fpu", "sse4_2", "avx", "fma", "avx2", "f16c", "bmi2"])
    assert describe(info).startswith("machine: AMD EPYC 7B13 64-Core Processor, ")
    assert describe(info).endswith("CPUs; flags: sse4_2 avx avx2 fma f16c")
    assert "flags: none" in describe(machine_info(cpuinfo=""))


def test_smt_siblings_are_named_where_a_core_runs_two_threads():
    smt = CPUINFO.replace("flags\t\t: fpu", "siblings\t: 2\ncpu cores\t: 1\nflags\t\t: fpu", 1)
    info = machine_info(cpuinfo=smt)
    assert info["threads_per_core"] == 2 and "(2 threads a core); flags: sse4_2" in describe(info)
    assert machine_info(cpuinfo=CPUINFO)["threads_per_core"] is None
