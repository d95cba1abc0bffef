"""`bench --baseline vllm`'s plumbing without vLLM: the spec, the environment, the result line, the
script half against a stand-in `vllm` module, the Session against a stand-in interpreter (rounds, a
script that dies or falls silent), `--rounds`, and the errors when the venv or the HF dir is missing."""

from __future__ import annotations

import io
import json
import os
import re
import sys
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

import benchmarks.throughput as bench_module
from benchmarks import vllm_baseline
from benchmarks.throughput import baseline_result, bench, make_workload
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
    from engine import openmp

    python = tmp_path / "bin" / "python"
    ours = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "20000", "PATH": "/bin"}
    monkeypatch.setattr(openmp, "SET_BY_ENGINE", frozenset({"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"}))
    env = vllm_baseline.subprocess_env(python, 2, ours)
    assert "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env and env["PATH"] == "/bin"
    monkeypatch.setattr(openmp, "SET_BY_ENGINE", frozenset({"GOMP_SPINCOUNT"}))  # the user set the policy
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
        vllm_baseline.Session({}, python=tmp_path / "nope" / "python")


def test_a_failing_script_reports_its_exit_and_output(tmp_path):
    # this venv has no vllm: the script's import fails, and the error carries the traceback's tail
    with pytest.raises(RuntimeError, match=r"exited 1:[\s\S]*vllm"):
        with vllm_baseline.Session({"model_dir": str(tmp_path)}, python=Path(sys.executable),
                                   num_threads=1) as session:
            session.round()


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


def _run_script(tmp_path, monkeypatch, wl, max_num_seqs: int, max_tokens: int, dtype: str,
                stdin: str) -> None:
    """The baseline script's main() on a spec of `wl`, reading `stdin`'s go lines."""
    spec = vllm_baseline.make_spec("/m", wl.prompts, wl.output_lens, max_num_seqs, max_tokens, dtype)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    vllm_baseline.main(str(tmp_path / "spec.json"))

def test_script_runs_the_spec_greedy_with_ignore_eos(tmp_path, monkeypatch, capsys):
    seen: dict = {}
    _stand_in_vllm(monkeypatch, seen)
    wl = make_workload(6, (3, 9), (2, 5), 100, seed=3)
    _run_script(tmp_path, monkeypatch, wl, 128, 8192, "bfloat16", vllm_baseline.GO + "\n")  # one round
    assert seen["llm"] == {"model": "/m", "dtype": "bfloat16", "seed": 0, "max_num_seqs": 128,
                           "max_num_batched_tokens": 8192, "enable_prefix_caching": False}
    warm, _ = seen["calls"][0]  # no warm-up prompt is a whole workload prompt (a cached prefix)
    assert len(warm) == 4 and all(p["ids"] not in wl.prompts for p in warm)
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


def _busy_child(tmp_path: Path, busy_s: float):
    """A child that spins for busy_s (forever if None), touches `done`, then sleeps."""
    import subprocess

    done = tmp_path / "done"
    until = "float('inf')" if busy_s is None else f"time.time() + {busy_s}"
    code = (f"import time, pathlib\nend = {until}\nwhile time.time() < end: pass\n"
            f"pathlib.Path({str(done)!r}).touch()\ntime.sleep(60)")
    return subprocess.Popen([sys.executable, "-c", code]), done


def test_wait_quiet_waits_out_a_busy_process(tmp_path):
    child, done = _busy_child(tmp_path, 1.0)
    try:
        waited = vllm_baseline.wait_quiet(child.pid, window_s=0.2)
        assert done.exists() and waited < 30  # not before its spin ended
    finally:
        child.kill()
        child.wait()


def test_wait_quiet_gives_up_on_a_process_that_never_idles(tmp_path):
    child, done = _busy_child(tmp_path, None)
    try:
        assert 1.0 <= vllm_baseline.wait_quiet(child.pid, window_s=0.2, max_s=1.0) < 5
        assert not done.exists()
    finally:
        child.kill()
        child.wait()


def _fake_vllm_python(tmp_path: Path, after_go: str, load: str = "") -> Path:
    """An executable standing in for .venv-vllm's python: ignores its arguments (the script and the
    spec), runs `load` (shell), says it is ready and answers each `go` line with `after_go` (shell,
    $n = the run's number)."""
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/bash\n{load}\necho {vllm_baseline.READY}\n"
                    "n=0\nwhile read line; do\n  [ \"$line\" = go ] || exit 3\n"
                    f"  n=$((n+1))\n  echo \"vLLM log line $n\"; echo \"warning $n\" >&2\n{after_go}\ndone\n")
    fake.chmod(0o755)
    return fake


ANSWER = 'echo "VLLM_RESULT {\\"elapsed_s\\": $n, \\"output_tokens\\": 10, \\"peak_rss_mb\\": 5}"'


def test_session_runs_one_timed_run_per_round_and_ends_with_stdin(tmp_path):
    with vllm_baseline.Session({"model_dir": "/m"}, python=_fake_vllm_python(tmp_path, ANSWER),
                               num_threads=1) as session:
        assert [session.round()["elapsed_s"] for _ in range(3)] == [1, 2, 3]
        proc = session.proc
    assert proc.returncode == 0  # stdin closed: the script's loop ended by itself


def test_session_reads_a_result_that_arrives_with_other_lines(tmp_path):
    """Log lines and the result in one write: the result must not wait in a buffer until timeout."""
    result = '{\\"elapsed_s\\": $n, \\"output_tokens\\": 1, \\"peak_rss_mb\\": 1}'
    both = f'printf "log a\\nlog b\\nVLLM_RESULT {result}\\n"'
    with vllm_baseline.Session({}, python=_fake_vllm_python(tmp_path, both), num_threads=1,
                               timeout_s=5) as session:
        assert [session.round()["elapsed_s"] for _ in range(2)] == [1, 2]


def test_session_reports_a_script_that_dies_between_rounds(tmp_path):
    dies = "  [ $n = 1 ] || { echo 'Killed: out of memory' >&2; exit 7; }\n"
    fake = _fake_vllm_python(tmp_path, dies + ANSWER)
    with vllm_baseline.Session({}, python=fake, num_threads=1) as session:
        assert session.round()["elapsed_s"] == 1
        with pytest.raises(RuntimeError, match=r"exited 7:[\s\S]*out of memory"):
            session.round()


def test_session_gives_up_on_a_silent_script(tmp_path):
    with vllm_baseline.Session({}, python=_fake_vllm_python(tmp_path, "  sleep 60"), num_threads=1,
                               timeout_s=1) as session:
        with pytest.raises(RuntimeError, match=r"no result in 1 s[\s\S]*vLLM log line 1"):
            session.round()
        assert session.proc.returncode is not None  # killed, not left running


def test_session_waits_for_the_script_to_load(tmp_path):
    loaded = tmp_path / "loaded"
    fake = _fake_vllm_python(tmp_path, ANSWER, load=f"sleep 0.5; touch {loaded}")
    with vllm_baseline.Session({}, python=fake, num_threads=1) as session:
        session.wait_ready()
        assert loaded.exists()
        assert session.round()["elapsed_s"] == 1


def test_session_gives_up_on_a_script_that_never_loads(tmp_path):
    fake = _fake_vllm_python(tmp_path, ANSWER, load="echo compiling; sleep 60")
    with vllm_baseline.Session({}, python=fake, num_threads=1, timeout_s=1) as session:
        with pytest.raises(RuntimeError, match=r"was not ready in 1 s[\s\S]*compiling"):
            session.round()


def test_script_waits_for_each_go(tmp_path, monkeypatch, capsys):
    seen: dict = {}
    _stand_in_vllm(monkeypatch, seen)
    wl = make_workload(3, (3, 5), (2, 3), 100, seed=1)
    _run_script(tmp_path, monkeypatch, wl, 8, 64, "float32", "go\ngo\n")
    out = capsys.readouterr().out
    assert out.count(vllm_baseline.RESULT_PREFIX) == 2 and len(seen["calls"]) == 3  # a warm-up, 2 runs
    assert out.splitlines()[0] == vllm_baseline.READY  # after the warm-up, before the first go


def test_bench_rounds_alternate_with_vllm_and_report_each(tmp_path, monkeypatch):
    loaded = tmp_path / "loaded"
    fake = _fake_vllm_python(tmp_path, ANSWER, load=f"sleep 0.5; touch {loaded}")
    monkeypatch.setenv(vllm_baseline.VENV_ENV, str(fake))
    monkeypatch.setattr("benchmarks.throughput._hf_dir", lambda model: str(tmp_path))
    run_engine = bench_module.run_engine

    def run_engine_after_vllm_loaded(*a, **kw):  # no timed run may share the CPU with vLLM's load
        assert loaded.exists()
        return run_engine(*a, **kw)

    monkeypatch.setattr(bench_module, "run_engine", run_engine_after_vllm_loaded)
    events = []
    monkeypatch.setattr(vllm_baseline, "wait_quiet", lambda pid: events.append(pid) or 0.0)
    specs = []

    class Session(vllm_baseline.Session):
        def __init__(self, spec, *a, **kw):
            specs.append(spec)
            super().__init__(spec, *a, **kw)

    monkeypatch.setattr(vllm_baseline, "Session", Session)
    flags = ["--model", "tiny-random", "--num-kv-blocks", "64", "--num-requests", "2", "--output-len", "2",
             "--prompt-len", "3", "--baseline", "vllm", "--rounds", "3"]
    result = CliRunner().invoke(bench, flags)
    assert result.exit_code == 0, result.output
    assert "fastest of 3 alternated rounds each" in result.output
    assert events == [os.getpid()] * 9  # before each of the 3 x 3 runs (greedy, sampled, vLLM), it went idle
    # batchgen's prefix caching (off here) and its own warm-up prompts, none of them the workload's
    assert specs[0]["enable_prefix_caching"] is False and len(specs[0]["warmup_prompts"]) == 4
    assert not set(map(tuple, specs[0]["warmup_prompts"])) & set(map(tuple, specs[0]["prompts"]))
    each = re.search(r"round by round: (.*)", result.output).group(1).split(", ")
    assert len(each) == 3 and all(re.fullmatch(r"[\d.]+x \([\d.]+ / [\d.]+\)", e) for e in each)
    assert re.search(r"ratio batchgen / vllm-cpu: [\d.]+x fastest, [\d.]+x median of 3 rounds", result.output)
    assert re.search(r"sampled \(temperature 1, .*\) / greedy output tokens/s: [\d.]+x fastest, [\d.]+x "
                     r"median of 3 rounds", result.output)
    assert re.search(r"^machine: .+, \d+ CPUs; flags: ", result.output, re.M)
    report = json.loads(CliRunner().invoke(bench, flags + ["--json"]).stdout)
    engine_runs, sampled_runs, vllm_runs = report["rounds"]
    assert [r["elapsed_s"] for r in vllm_runs] == [1, 2, 3]  # the fake's runs, in order
    assert report["results"][2]["elapsed_s"] == 1  # the fastest reported
    assert len(engine_runs) == 3 and report["results"][0] in engine_runs
    assert [r["name"] for r in report["results"]] == ["batchgen", "batchgen-t1", "vllm-cpu"]
    vs_vllm = report["ratios"]["vllm-cpu"]
    assert len(vs_vllm["rounds"]) == 3 and vs_vllm["median"] == sorted(vs_vllm["rounds"])[1]
    assert report["machine"]["cpus"] == os.cpu_count() and "cpu_model" in report["machine"]


@pytest.mark.parametrize("baseline, share, rounds", [("none", None, 1), ("hf", None, 1), ("vllm", None, 2),
                                                      ("all", None, 2), ("none", 0.5, 2)])
def test_default_rounds_alternate_where_a_ratio_is_quoted(baseline, share, rounds):
    assert bench_module.default_rounds(baseline, share) == rounds


def test_bench_against_vllm_runs_two_rounds_unless_told(tmp_path, monkeypatch):
    monkeypatch.setenv(vllm_baseline.VENV_ENV, str(_fake_vllm_python(tmp_path, ANSWER)))
    monkeypatch.setattr("benchmarks.throughput._hf_dir", lambda model: str(tmp_path))
    monkeypatch.setattr(vllm_baseline, "wait_quiet", lambda pid: 0.0)
    flags = ["--model", "tiny-random", "--num-kv-blocks", "64", "--num-requests", "2", "--output-len", "2",
             "--prompt-len", "3", "--baseline", "vllm", "--json"]
    for extra, n in [([], 2), (["--rounds", "1"], 1)]:
        result = CliRunner().invoke(bench, flags + extra)
        assert result.exit_code == 0, result.output
        assert [len(kind) for kind in json.loads(result.stdout)["rounds"]] == [n, n, n]


@pytest.mark.parametrize("flag, cached", [([], False), (["--enable-prefix-caching"], True)])
def test_bench_gives_vllm_batchgens_prefix_caching(tmp_path, monkeypatch, flag, cached):
    """vLLM's own default is on: left to it, every round after the first replays cached prompts."""
    monkeypatch.setenv(vllm_baseline.VENV_ENV, str(_fake_vllm_python(tmp_path, ANSWER)))
    monkeypatch.setattr("benchmarks.throughput._hf_dir", lambda model: str(tmp_path))
    monkeypatch.setattr(vllm_baseline, "wait_quiet", lambda pid: 0.0)
    specs = []
    monkeypatch.setattr(vllm_baseline, "make_spec",
                        lambda *a, make=vllm_baseline.make_spec: specs.append(make(*a)) or specs[-1])
    flags = ["--model", "tiny-random", "--num-kv-blocks", "64", "--num-requests", "2", "--output-len", "2",
             "--prompt-len", "3", "--baseline", "vllm"]
    result = CliRunner().invoke(bench, flags + flag)
    assert result.exit_code == 0, result.output
    assert specs[0]["enable_prefix_caching"] is cached
