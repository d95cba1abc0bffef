"""The OpenMP waiting `batchgen` sets before torch loads (engine/openmp.py: nothing at import) and
what `batchgen run` hands its workers (jobs.local_run.worker_env)."""

import os
import subprocess
import sys

import pytest

from engine import openmp
from jobs.broker import BROKER_ENV
from jobs.local_run import worker_env
from jobs.parent_watch import PARENT_PID_ENV

SHOW = ("print(os.environ.get('OMP_WAIT_POLICY', '-'), os.environ.get('GOMP_SPINCOUNT', '-'), "
        "','.join(sorted(openmp.SET_BY_ENGINE)) or '-', 'torch' in sys.modules)")
# `batchgen --version` through the console script's main (click exits when it is done)
MAIN_PROBE = ("import os, sys; sys.argv = ['batchgen', '--version']; from jobs import cli\n"
              "try:\n    cli.main()\nexcept SystemExit:\n    pass\nfrom engine import openmp; " + SHOW)
IMPORT_PROBE = "import os, sys, engine, engine.llm; from engine import openmp; " + SHOW


def _probe(code: str, **env) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         check=True)
    return out.stdout.split()[-4:]


def test_batchgen_sleeps_after_a_brief_spin_by_default_set_before_torch_and_a_users_setting_wins():
    assert _probe(MAIN_PROBE) == ["PASSIVE", "20000", "GOMP_SPINCOUNT,OMP_WAIT_POLICY", "False"]
    assert _probe(MAIN_PROBE, GOMP_SPINCOUNT="500") == ["PASSIVE", "500", "OMP_WAIT_POLICY", "False"]
    user = {"GOMP_SPINCOUNT": "500", "OMP_WAIT_POLICY": "ACTIVE"}
    assert _probe(MAIN_PROBE, **user) == ["ACTIVE", "500", "-", "False"]


def test_importing_the_engine_sets_nothing():
    assert _probe(IMPORT_PROBE) == ["-", "-", "-", "True"]


def test_setting_the_defaults_twice_keeps_what_the_first_call_set(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "unset below; restored after the test")
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    monkeypatch.setattr(openmp, "SET_BY_ENGINE", frozenset())
    assert openmp.set_openmp_defaults() == {"OMP_WAIT_POLICY"}
    assert openmp.set_openmp_defaults() == frozenset()
    assert openmp.SET_BY_ENGINE == {"OMP_WAIT_POLICY"} and os.environ["GOMP_SPINCOUNT"] == "7"


@pytest.mark.parametrize("workers, engine_set_it, given, expected", [
    (1, True, None, None),        # one worker has the cores to itself: the engine's default spin
    (2, True, "20000", "0"),      # workers share the cores: no spinning
    (3, True, None, "0"),
    (2, False, "500", "500"),     # the user's own setting is kept
])
def test_workers_that_share_the_cores_do_not_spin(monkeypatch, workers, engine_set_it, given, expected):
    monkeypatch.setattr(openmp, "SET_BY_ENGINE", frozenset({"GOMP_SPINCOUNT"} if engine_set_it else ()))
    environ = {"HOME": "/x", BROKER_ENV: "redis://elsewhere"}
    if given is not None:
        environ["GOMP_SPINCOUNT"] = given
    env = worker_env(environ, workers)
    assert env.get("GOMP_SPINCOUNT") == expected
    assert env["HOME"] == "/x" and BROKER_ENV not in env and env[PARENT_PID_ENV] == str(os.getpid())


WORKER_PROBE = ("import os, sys; from jobs import commands; commands.worker_openmp_wait(); "
                "print(os.environ['GOMP_SPINCOUNT'], 'torch' in sys.modules)")


def test_a_worker_started_on_its_own_does_not_spin_unless_told():
    """`batchgen worker` may share its machine: no spin by default, set before torch (and libgomp)
    loads; a GOMP_SPINCOUNT it was given (by the user, or by `batchgen run` as its only worker) stays."""
    clean = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    for given, expected in ((None, "0 False"), ("20000", "20000 False")):
        env = clean if given is None else {**clean, "GOMP_SPINCOUNT": given}
        out = subprocess.run([sys.executable, "-c", WORKER_PROBE], env=env, capture_output=True, text=True,
                             check=True)
        assert out.stdout.strip() == expected


def test_the_engines_threads_come_from_the_flag_then_omp_num_threads_then_the_affinity_mask(monkeypatch):
    monkeypatch.delenv(openmp.THREADS_ENV, raising=False)
    assert openmp.engine_threads(3) == 3
    assert openmp.engine_threads() == len(os.sched_getaffinity(0))
    monkeypatch.setenv(openmp.THREADS_ENV, "5")
    assert openmp.engine_threads() == 5
    assert openmp.engine_threads(2) == 2
    for bad in ("many", "0"):
        monkeypatch.setenv(openmp.THREADS_ENV, bad)
        with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
            openmp.engine_threads()


def test_a_bad_cpu_threads_is_refused_naming_it():
    from engine import EngineConfig

    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="cpu_threads"):
            EngineConfig(model="tiny-random", cpu_threads=bad)


def test_an_engine_steps_on_its_thread_count_whichever_thread_steps_it():
    """torch's count is per thread (a worker steps its engine from a thread of its own, a script from
    its main thread): each step sets the engine's count on the thread that runs it."""
    import threading

    import torch

    from engine import EngineConfig, SamplingParams
    from engine.llm_engine import LLMEngine

    before = torch.get_num_threads()
    try:
        engine = LLMEngine(EngineConfig(model="tiny-random", max_num_seqs=2, cpu_threads=3))
        assert engine.cpu_threads == 3
        seen = []

        def run_one(name: str) -> None:
            torch.set_num_threads(1)  # what this thread had before
            engine.add_request(name, "a prompt", SamplingParams(max_tokens=2, temperature=0.0))
            while engine.has_unfinished_requests():
                engine.step()
                seen.append((name, torch.get_num_threads()))

        run_one("main")
        thread = threading.Thread(target=run_one, args=("thread",))
        thread.start()
        thread.join()
        assert {n for n, _ in seen} == {"main", "thread"} and {t for _, t in seen} == {3}, seen
    finally:
        torch.set_num_threads(before)


def test_workers_started_together_split_the_cpus_unless_told(monkeypatch):
    cpus = len(os.sched_getaffinity(0))
    assert "OMP_NUM_THREADS" not in worker_env({"HOME": "/x"}, 1)  # one worker: every CPU
    assert worker_env({"HOME": "/x"}, 2)["OMP_NUM_THREADS"] == str(max(1, cpus // 2))
    assert worker_env({"HOME": "/x"}, 4 * cpus)["OMP_NUM_THREADS"] == "1"  # never none
    assert worker_env({"OMP_NUM_THREADS": "3"}, 2)["OMP_NUM_THREADS"] == "3"  # the user's stays
