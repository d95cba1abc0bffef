"""A real small engine run's iteration telemetry, written through the store and read back from the view."""

from __future__ import annotations

from engine import LLM, SamplingParams
from jobs.store.catalog import connect
from jobs.store.parts import Store

COLUMNS = ("iteration", "scheduled_tokens", "token_budget", "num_scheduled_seqs", "max_num_seqs",
           "prefill_tokens", "decode_tokens", "kv_blocks_used", "kv_blocks_total", "num_finished")


def test_engine_iterations_rows_satisfy_the_budget_invariants(tmp_path):
    llm = LLM(model="tiny-random", max_num_seqs=4, max_num_batched_tokens=32, block_size=4, num_kv_blocks=40)
    prompts = [("batching " * (1 + 3 * i))[: 8 + 9 * i] for i in range(7)]  # 8..62 chars: some chunked
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert len(outs) == len(prompts)
    stats = list(llm.iteration_stats)
    assert stats

    store = Store(tmp_path)
    with store.telemetry_buffer("engine-test") as buf:
        buf.extend(stats)
    con = connect(tmp_path)
    rows = con.execute(f"SELECT {', '.join(COLUMNS)} FROM iterations ORDER BY iteration").fetchall()
    con.close()

    assert len(rows) == len(stats)
    for values in rows:
        row = dict(zip(COLUMNS, values, strict=True))
        assert row["token_budget"] == 32 and row["max_num_seqs"] == 4, row
        assert row["scheduled_tokens"] <= row["token_budget"], row
        assert row["num_scheduled_seqs"] <= row["max_num_seqs"], row
        assert row["prefill_tokens"] + row["decode_tokens"] == row["scheduled_tokens"], row
        assert row["kv_blocks_used"] <= row["kv_blocks_total"] == 40, row
    assert sum(r[COLUMNS.index("num_finished")] for r in rows) == len(prompts)
    assert max(r[COLUMNS.index("scheduled_tokens")] for r in rows) == 32  # the budget did bind
