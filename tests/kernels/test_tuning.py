"""The tuner: a candidate wins only if its output agrees with the torch reference, "no candidate ran"
is said as such, the deadline holds, and candidates are compiled in a pool of processes."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kernels import tile_configs, tuning
from tests.kernels.cases import require_triton

require_triton()


@dataclass(frozen=True)
class _Case:
    """A TuneCase stand-in: config "wrong" computes the wrong thing (fast), "broken" does not compile."""

    key: str = "decode/d16/float32"

    def inputs(self):
        return torch.arange(6.0)

    def reference(self, x):
        return x * 2

    def run(self, x, config):
        if config["name"] == "broken":
            raise RuntimeError("out of resource: shared memory, Required: 262144, Hardware limit: 232448")
        return x * (3 if config["name"] == "wrong" else 2)

    def mismatch(self, got, want):
        return None if torch.equal(got, want) else "max error 6"


CONFIGS = {name: {"name": name} for name in ("slow", "wrong", "fast", "broken")}


def test_the_fastest_candidate_that_agrees_with_the_reference_wins():
    timings = iter([3.0, 1.0])  # slow, fast (wrong and broken are never timed)
    result = tuning.tune(_Case(), list(CONFIGS.values()), lambda fn: (fn(), next(timings))[1],
                         log=lambda m: None)
    assert result.best == CONFIGS["fast"]
    assert [c["name"] for c, _ in result.timings] == ["slow", "fast"]
    assert [(c["name"], why) for c, why in result.rejected] == [("wrong", "max error 6")]
    assert [c["name"] for c, _ in result.failed] == ["broken"]
    assert "out of resource" in result.failed[0][1]


def test_no_candidate_ran_is_a_result_of_its_own_never_the_defaults():
    result = tuning.tune(_Case(), [CONFIGS["wrong"], CONFIGS["broken"]], lambda fn: 1.0, log=lambda m: None)
    assert result.best is None and not result.timings
    assert len(result.rejected) == 1 and len(result.failed) == 1


def test_the_deadline_stops_the_tuner():
    result = tuning.tune(_Case(), list(CONFIGS.values()), lambda fn: 1.0, deadline=time.monotonic() - 1,
                         log=lambda m: None)
    assert result.best is None and result.not_reached == len(CONFIGS)


def test_candidates_compile_in_a_pool_and_a_real_case_checks_against_the_torch_reference():
    """Through the interpreter at toy sizes: a valid candidate builds and wins, one the kernel refuses
    (a block of 24 keys: tl.arange needs a power of two) is reported with why."""
    case = tuning.TuneCase("decode", (4, 2, 16), "float32", "cpu", quick=True)
    good = {"BLOCK_N": 16, "num_warps": 2, "num_stages": 1}
    bad = {"BLOCK_N": 24, "num_warps": 2, "num_stages": 1}
    built = tuning.compile_candidates([case], {"decode": [good, bad]}, workers=2,
                                      deadline=time.monotonic() + 300, log=lambda m: None)
    assert built[case.key][0] is None and built[case.key][1] is not None
    result = tuning.tune(case, [good], lambda fn: (fn(), 1.0)[1], log=lambda m: None)
    assert result.best == good and not result.rejected
    assert case.mismatch(case.run(case.inputs(), good) + 1.0, case.reference(case.inputs())) is not None


def test_a_compile_deadline_leaves_the_rest_unbuilt():
    case = tuning.TuneCase("decode", (4, 2, 16), "float32", "cpu", quick=True)
    built = tuning.compile_candidates([case], {"decode": tuning.CANDIDATES["decode"][:3]}, workers=1,
                                      deadline=time.monotonic(), log=lambda m: None)
    assert built == {case.key: {}}


def test_a_table_is_written_where_told_and_read_only_when_named(tmp_path, monkeypatch):
    tuned = {"decode/d64/bfloat16": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}}
    path = tuning.write_table("H200", tuned, tmp_path / "H200.json")
    assert path == tmp_path / "H200.json" and not (tuning.CONFIG_DIR / "H200.json").exists()
    monkeypatch.setattr(tile_configs, "gpu_name", lambda device: "H200")
    cuda = torch.device("cuda", 0)
    assert tuning.decode_config(cuda, 64, torch.bfloat16) == tuning.DEFAULTS["decode"]
    monkeypatch.setenv(tuning.ENV_FILE, str(path))
    tuning.clear_cache()
    try:
        assert tuning.decode_config(cuda, 64, torch.bfloat16)["BLOCK_N"] == 64
    finally:
        monkeypatch.delenv(tuning.ENV_FILE)
        tuning.clear_cache()
