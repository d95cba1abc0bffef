"""The OpenMP waiting the engine sets before torch loads (engine/__init__.py) and what `batchgen run`
hands its workers (jobs.local_run.worker_env)."""

import os
import subprocess
import sys

import pytest

import engine
from jobs.broker import BROKER_ENV
from jobs.local_run import worker_env
from jobs.parent_watch import PARENT_PID_ENV

PROBE = ("import os, engine; print(os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT'], "
         "','.join(sorted(engine.SET_BY_ENGINE)) or '-')")


def _import_engine(**env) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                         check=True)
    return out.stdout.split()


def test_the_engine_sleeps_after_a_brief_spin_by_default_and_a_users_setting_wins():
    assert _import_engine() == ["PASSIVE", "20000", "GOMP_SPINCOUNT,OMP_WAIT_POLICY"]
    assert _import_engine(GOMP_SPINCOUNT="500") == ["PASSIVE", "500", "OMP_WAIT_POLICY"]
    assert _import_engine(GOMP_SPINCOUNT="500", OMP_WAIT_POLICY="ACTIVE") == ["ACTIVE", "500", "-"]


@pytest.mark.parametrize("workers, engine_set_it, given, expected", [
    (1, True, None, None),        # one worker has the cores to itself: the engine's default spin
    (2, True, "20000", "0"),      # workers share the cores: no spinning
    (3, True, None, "0"),
    (2, False, "500", "500"),     # the user's own setting is kept
])
def test_workers_that_share_the_cores_do_not_spin(monkeypatch, workers, engine_set_it, given, expected):
    monkeypatch.setattr(engine, "SET_BY_ENGINE", frozenset({"GOMP_SPINCOUNT"} if engine_set_it else ()))
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
