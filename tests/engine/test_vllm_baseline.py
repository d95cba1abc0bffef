"""`bench --baseline vllm`'s plumbing without vLLM: the spec, the environment, the result line, the
script half against a stand-in `vllm` module, and the errors when the venv or the HF dir is missing."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from engine import vllm_baseline
from engine.bench import baseline_result, bench, make_workload
from engine.model import PRESETS


def test_env_binds_threads_and_drops_our_path(tmp_path):
    python = tmp_path / "bin" / "python"
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    env = vllm_baseline.subprocess_env(python, 2, {"PYTHONPATH": "/x", "PATH": "/bin"})
    assert "PYTHONPATH" not in env and env["PATH"] == "/bin"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["LD_PRELOAD"].endswith(str(tmp_path / "lib" / "libiomp5.so"))
    mine = vllm_baseline.subprocess_env(python, 4, {"VLLM_CPU_KVCACHE_SPACE": "9", "LD_PRELOAD": "a.so"})
    assert mine["VLLM_CPU_KVCACHE_SPACE"] == "9" and mine["LD_PRELOAD"] == "a.so"


def test_vllm_waits_its_own_way_unless_the_user_chose(monkeypatch, tmp_path):
    import engine

    python = tmp_path / "bin" / "python"
    ours = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "20000", "PATH": "/bin"}
    monkeypatch.setattr(engine, "SET_BY_ENGINE", frozenset({"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"}))
    env = vllm_baseline.subprocess_env(python, 2, ours)
    assert "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env and env["PATH"] == "/bin"
    monkeypatch.setattr(engine, "SET_BY_ENGINE", frozenset({"GOMP_SPINCOUNT"}))  # the user set the policy
    assert vllm_baseline.subprocess_env(python, 2, ours)["OMP_WAIT_POLICY"] == "PASSIVE"


def test_parse_result_takes_the_last_result_line():
    out = "INFO loading\nVLLM_RESULT {\"elapsed_s\": 1}\nVLLM_RESULT " + json.dumps(
        {"elapsed_s": 2.0, "output_tokens": 10, "peak_rss_mb": 5.0}) + "\nbye\n"
    assert vllm_baseline.parse_result(out)["elapsed_s"] == 2.0
    with pytest.raises(RuntimeError, match="lacks output_tokens, peak_rss_mb"):
        vllm_baseline.parse_result("VLLM_RESULT {\"elapsed_s\": 1}")
    with pytest.raises(RuntimeError, match=r"no VLLM_RESULT line[\s\S]*Traceback"):
        vllm_baseline.parse_result("a\nTraceback: boom\n")


def test_missing_interpreter_says_how_to_make_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="make vllm-baseline"):
        vllm_baseline.run({}, python=tmp_path / "nope" / "python")


def test_a_failing_script_reports_its_exit_and_output(tmp_path):
    # this venv has no vllm: the script's import fails, and the error carries the traceback's tail
    with pytest.raises(RuntimeError, match=r"exited 1:[\s\S]*vllm"):
        vllm_baseline.run({"model_dir": str(tmp_path)}, python=Path(sys.executable), num_threads=1)


def _stand_in_vllm(monkeypatch, seen: dict) -> None:
    class LLM:
        def __init__(self, **kw):
            seen["llm"] = kw

        def generate(self, prompts, params, use_tqdm=True):
            seen.setdefault("calls", []).append((prompts, params))
            out = types.SimpleNamespace
            return [out(outputs=[out(token_ids=[7] * p.max_tokens)]) for p in params]

    def sampling_params(**kw):
        return types.SimpleNamespace(**kw)

    vllm = types.SimpleNamespace(LLM=LLM, SamplingParams=sampling_params, __version__="0.0-test")
    inputs = types.SimpleNamespace(TokensPrompt=lambda prompt_token_ids: {"ids": prompt_token_ids})
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)


def test_script_runs_the_spec_greedy_with_ignore_eos(tmp_path, monkeypatch, capsys):
    seen: dict = {}
    _stand_in_vllm(monkeypatch, seen)
    wl = make_workload(6, (3, 9), (2, 5), 100, seed=3)
    spec = vllm_baseline.make_spec("/m", wl.prompts, wl.output_lens, 128, 8192, "bfloat16")
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    vllm_baseline.main(str(tmp_path / "spec.json"))
    assert seen["llm"] == {"model": "/m", "dtype": "bfloat16", "seed": 0, "max_num_seqs": 128,
                           "max_num_batched_tokens": 8192}
    prompts, params = seen["calls"][-1]  # the timed call, after a warm-up
    assert [p["ids"] for p in prompts] == wl.prompts
    assert [p.max_tokens for p in params] == wl.output_lens
    assert all(p.temperature == 0.0 and p.ignore_eos for p in params)
    got = vllm_baseline.parse_result(capsys.readouterr().out)
    assert got["output_tokens"] == wl.output_tokens and got["peak_rss_mb"] > 0
    result = baseline_result("vllm-cpu", got, wl, 1e9, PRESETS["tiny"])
    assert result.output_tokens_per_s == pytest.approx(wl.output_tokens / got["elapsed_s"])


def test_bench_baseline_vllm_needs_an_hf_directory():
    flags = ["--model", "tiny-random", "--num-kv-blocks", "64", "--num-requests", "2", "--output-len", "2",
             "--prompt-len", "3", "--baseline", "vllm"]
    result = CliRunner().invoke(bench, flags)
    assert result.exit_code == 2 and "Hugging Face directory" in result.output


def test_peak_rss_counts_grandchildren(tmp_path):
    """vLLM's model worker is a grandchild of the script (under its engine core): it must count."""
    import subprocess
    import sys
    import time

    ready = tmp_path / "ready"
    grandchild = (f"import time, pathlib; b = bytearray(200 << 20); pathlib.Path({str(ready)!r})"
                  ".write_text('x'); time.sleep(60)")
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {grandchild!r}])"
    child = subprocess.Popen([sys.executable, "-c", parent])
    try:
        for _ in range(300):
            if ready.exists():
                break
            time.sleep(0.1)
        assert ready.exists()
        tree = vllm_baseline._descendants(child.pid)
        assert len(tree) == 2 and tree[0] == child.pid
        assert vllm_baseline._peak_rss_mb(child.pid) > 200  # the grandchild's 200 MiB buffer is in
    finally:
        subprocess.run(["pkill", "-f", str(ready)], check=False)  # the grandchild
        child.kill()
        child.wait()
