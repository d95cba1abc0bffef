"""`make gpu-check` must run on its first try on the GPU image, end in bounded time whatever hangs,
and report a failure as FAILED, never as a number. On the CPU: the device resolution its CUDA path
takes (with torch.cuda's answers scripted), the orchestration of section processes (time limits,
kills, FAILED rows, a table written after every section), the checks that turn a bad measurement
into a FAILED row, and a dry run of every section (`--device cpu --quick`, Triton interpreter)
with any import outside the GPU image's packages refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check
from benchmarks.gpu_check import Context, Results, Section, Sink

ROOT = Path(__file__).resolve().parents[2]
GPU_IMAGE_PACKAGES = ["torch", "triton", "numpy", "click", "jinja2", "tokenizers", "safetensors", "pyarrow",
                      "transformers", "prometheus_client"]


# -- the device: `cuda` is the default


@pytest.fixture
def two_gpus(monkeypatch):
    """torch.cuda answering as on a machine with two GPUs (nothing initialised yet); returns the
    indices torch.cuda.set_device handed to the driver."""
    set_to = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_setDevice", set_to.append, raising=False)
    return set_to


def test_the_default_device_cuda_resolves_to_an_index_set_device_accepts(two_gpus):
    """gpu_check crashed on its default: torch.cuda.set_device(torch.device("cuda")) raises."""
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.set_device(torch.device("cuda"))  # what the old code did first
    for name, index in (("cuda", 0), ("cuda:1", 1), ("cuda:0", 0)):
        device = gpu_check.resolve_device(name)
        assert device == torch.device("cuda", index)
        gpu_check.use_device(device)  # what every section's process does first
    assert two_gpus == [0, 1, 0]
    with pytest.raises(ValueError, match="2 CUDA device"):
        gpu_check.resolve_device("cuda:2")
    with pytest.raises(ValueError, match="cuda, cuda:N or cpu"):
        gpu_check.resolve_device("mps")
    assert gpu_check.resolve_device("cpu") == torch.device("cpu")


def test_cuda_once_initialised_means_the_current_device(two_gpus, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert gpu_check.resolve_device("cuda") == torch.device("cuda", 1)


def test_no_cuda_device_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", "unused"]) == 2
    assert "no CUDA device here; run with --device cpu --quick" in capsys.readouterr().err


# -- the orchestration: section processes under hard limits


def _sections(*names_and_limits) -> list[Section]:
    return [Section(name, f"tests.benchmarks.gpu_check_sections:{fn}", limit)
            for name, fn, limit in names_and_limits]


def _ctx(tmp_path) -> Context:
    return Context("cpu", "float32", True, str(tmp_path), 0.0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rpartition(")")[2].split()[:1] != ["Z"]


# The hung sections' limits here are under MIN_SECTION_S (which only keeps a real run from starting a
# section it cannot finish): run_sections takes the minimum as a parameter, so they wait out seconds,
# not tens of them. HANG_S leaves a section's process time to start and write its first row.
HANG_S = 8


def test_every_section_ends_within_its_limit_and_each_failure_is_a_failed_row(tmp_path):
    sections = _sections(("first", "measures", 60), ("hung", "hangs", HANG_S), ("raising", "raises", 60),
                         ("dying", "dies", 60), ("last", "reads_the_table", 60))
    t0 = time.monotonic()
    results = gpu_check.run_sections(sections, _ctx(tmp_path), tmp_path, budget_s=400, min_section_s=1)
    took = time.monotonic() - t0
    rows = {(r.section, r.item): r for r in results.rows}
    assert rows[("first", "measured")].status == "ok" and rows[("first", "measured")].value == "1.5"
    assert rows[("hung", "started")].status == "ok"  # what it wrote before it hung is kept
    hung = rows[("hung", "section")]
    assert (hung.status, hung.value) == ("FAILED", f"timed out: killed after {HANG_S} s")
    assert not _alive(results.data["hung"]["helper_pid"])  # its helper process was killed with it
    raised = rows[("raising", "raised")]
    assert raised.status == "FAILED"
    assert raised.value == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert rows[("raising", "before the error")].status == "ok"
    dying = rows[("dying", "section")]
    assert dying.status == "FAILED" and "exited with code 3" in dying.value
    assert took < HANG_S + 4 * 60  # each section's own limit held (the hang cost its HANG_S, no more)
    before = results.data["last"]["table"]  # the table as it was when the last section began
    assert "| first | measured | 1.5 |" in before and "FAILED: timed out" in before and "| dying |" in before
    assert results.failures == 3
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["complete"] and saved["failures"] == 3 and saved["data"]["first"]["value"] == 1.5
    assert (tmp_path / "gpu_check.md").read_text().strip() == results.table()


def test_the_budget_bounds_the_whole_run_and_a_section_left_without_time_is_skipped(tmp_path):
    sections = _sections(("hung", "hangs", 100), ("after", "measures", 100))
    t0 = time.monotonic()
    results = gpu_check.run_sections(sections, _ctx(tmp_path), tmp_path, budget_s=4, min_section_s=1)
    assert time.monotonic() - t0 < 4 + 15
    rows = {(r.section, r.item): r for r in results.rows}
    assert rows[("hung", "section")].value == "timed out: killed after 4 s"
    assert rows[("after", "section")].status == "SKIPPED"
    assert "left of the 4 s budget" in rows[("after", "section")].value


def test_by_default_a_section_with_less_than_min_section_s_is_skipped_unstarted(tmp_path, monkeypatch):
    """The production minimum (what main() runs with): a section whose limit, or what is left of the
    budget, is under MIN_SECTION_S is a SKIPPED row and no process; one at the minimum runs."""
    started = []
    monkeypatch.setattr(gpu_check, "_run_one", lambda section, *args: started.append(section.name))
    least = gpu_check.MIN_SECTION_S
    sections = [Section("short", "x:y", least - 0.5), Section("enough", "x:y", least + 0.5)]
    results = gpu_check.run_sections(sections, _ctx(tmp_path), tmp_path, budget_s=400)
    assert started == ["enough"]
    assert [(r.section, r.status) for r in results.rows] == [("short", "SKIPPED")]
    results = gpu_check.run_sections([Section("after", "x:y", 100)], _ctx(tmp_path), tmp_path,
                                     budget_s=least - 1)
    assert started == ["enough"]
    (row,) = results.rows
    assert (row.status, row.value) == ("SKIPPED", f"{least - 1:.0f} s left of the {least - 1:.0f} s budget")


def test_a_tuned_table_is_named_for_the_sections_after_tuning_only(tmp_path, monkeypatch):
    table = tmp_path / "gpu.json"
    table.write_text("{}")
    seen = []

    def run_one(section, ctx, out_dir, limit, env, results):
        seen.append((section.name, env.get("BATCHGEN_KERNEL_CONFIGS")))
        if section.name == "tuning":
            results.data["tuning"] = {"table": str(table)}

    monkeypatch.setattr(gpu_check, "_run_one", run_one)
    env = gpu_check.section_env_vars(torch.device("cpu"))
    assert env["TRITON_INTERPRET"] == "1"
    sections = [Section(n, "x:y", 60) for n in ("kernels", "tuning", "engine toy")]
    gpu_check.run_sections(sections, _ctx(tmp_path), tmp_path, 400, env)
    assert seen == [("kernels", None), ("tuning", None), ("engine toy", str(table))]


# -- measurements that must be FAILED rows


@pytest.fixture(scope="module")
def ckpt():
    from tests.engine.tiny import tiny_hf_checkpoint

    return tiny_hf_checkpoint(seed=5)


def _rows(path: Path) -> list[dict]:
    results = Results()
    results.read(path)
    return [{"item": r.item, "status": r.status, "value": r.value} for r in results.rows]


def _llm(ckpt, **config):
    from engine import LLM

    return LLM("tiny", checkpoint=ckpt, **{"max_num_seqs": 4, "max_num_batched_tokens": 32, "block_size": 4,
                                             "num_kv_blocks": 64, **config})


def test_requests_that_end_in_errors_are_a_failed_row_not_a_throughput(ckpt, tmp_path):
    from benchmarks.throughput import make_workload

    llm = _llm(ckpt)
    real = llm.engine.runner.model.forward

    def forward(input_ids, *args, **kwargs):  # a request's fault (not the device's): error rows
        if bool((input_ids == 7).any()):
            raise ValueError("a kernel refused this request")
        return real(input_ids, *args, **kwargs)

    llm.engine.runner.model.forward = forward
    workload = make_workload(3, (4, 6), (2, 3), 90, seed=0)
    workload.prompts[1][0] = 7
    gpu_check.bench(Sink(tmp_path / "rows.jsonl", "engine"), llm, workload, "bench")
    (row,) = _rows(tmp_path / "rows.jsonl")
    assert row["status"] == "FAILED" and "tok/s" not in row["value"]
    assert row["value"].startswith("1 of 3 requests ended in errors; first: ")
    assert "a kernel refused this request" in row["value"]


def test_a_triton_compile_in_a_timed_run_is_a_failed_row(ckpt, tmp_path, monkeypatch):
    from benchmarks.throughput import make_workload

    counts = iter([10, 12])
    monkeypatch.setattr(gpu_check, "triton_compiles", lambda: next(counts))
    workload = make_workload(2, (4, 6), (2, 3), 90, seed=0)
    gpu_check.bench(Sink(tmp_path / "rows.jsonl", "engine"), _llm(ckpt), workload, "bench")
    (row,) = _rows(tmp_path / "rows.jsonl")
    assert row["status"] == "FAILED" and row["value"] == "2 Triton compile(s) during the timed run"


def test_more_than_one_host_sync_per_decode_step_is_a_failed_row(ckpt, tmp_path):
    llm = _llm(ckpt)
    staging = llm.engine.runner.staging
    execute = llm.engine.runner.execute
    # one wait too many
    llm.engine.runner.execute = lambda sched, feed=None: (staging.wait(), execute(sched, feed))[1]
    gpu_check.decode_step(Sink(tmp_path / "rows.jsonl", "engine"), llm, torch.device("cpu"), quick=True)
    rows = _rows(tmp_path / "rows.jsonl")
    assert [r["status"] for r in rows] == ["FAILED"]
    assert rows[0]["item"].endswith("host syncs per step") and rows[0]["value"].startswith("2.0 (2.0 of them")


@pytest.mark.parametrize("name,ok", [("torch", False), ("cpu-native", True)])
def test_a_graph_replay_that_picks_other_tokens_than_the_eager_step_is_a_failed_row(ckpt, tmp_path, name, ok):
    """decode_step's graph check over decode graphs emulated on the CPU (a replay keeps the host-side
    values of its capture): the torch backend's replays attend to one key, and are caught."""
    from kernels import ops
    from tests.engine.test_gpu_path import _with_emulated_graphs

    ops.set_backend(name)
    try:
        llm = _llm(ckpt)
        _with_emulated_graphs(llm)
        gpu_check.decode_step(Sink(tmp_path / "rows.jsonl", "engine"), llm, torch.device("cpu"), quick=True)
    finally:
        ops.set_backend(None)
    check = next(r for r in _rows(tmp_path / "rows.jsonl") if r["item"] == "graph replay vs eager step")
    assert (check["status"] == "ok") == ok, check
    assert check["value"] == ("5 rows, same tokens" if ok else check["value"])
    if not ok:
        assert check["value"].endswith("of 5 rows pick another token")


def test_a_failing_profiler_fails_nothing_else():
    class Engine:
        def step(self):
            raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    busy = gpu_check.gpu_busy_share(Engine(), torch.device("cuda", 0), steps=3)
    assert busy.startswith("n/a (profiler failed: ")


# -- the whole run, dry


GUARD = '''
import sys
ROOT = {root!r}
ALLOWED = set({allowed!r}) | {{"engine", "kernels", "benchmarks"}}


class _OnlyWhatTheGpuImageHas:
    """Refuse third-party imports made by the project's own files outside the GPU image's packages."""

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if path is not None or top in ALLOWED or top in sys.stdlib_module_names:
            return None
        frame = sys._getframe(1)
        while frame is not None and ("importlib" in frame.f_code.co_filename
                                     or frame.f_code.co_filename.startswith("<frozen")):
            frame = frame.f_back
        where = frame.f_code.co_filename if frame is not None else ""
        if where.startswith(ROOT) and "/.venv" not in where:
            raise ImportError(f"{{where}} imports {{name!r}}, which the GPU image does not have")
        return None


sys.meta_path.insert(0, _OnlyWhatTheGpuImageHas())
'''


@pytest.mark.slow
def test_dry_run_goes_through_every_section_with_only_the_gpu_image_packages(tmp_path):
    guard_dir = tmp_path / "guard"
    guard_dir.mkdir()
    (guard_dir / "sitecustomize.py").write_text(GUARD.format(root=str(ROOT), allowed=GPU_IMAGE_PACKAGES))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(guard_dir), str(ROOT)])
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    table = (out / "gpu_check.md").read_text()
    for section in ("env", "kernels", "decode attention", "tuning", "engine toy"):
        assert f"| {section} |" in table, section
    assert "FAILED" not in table and "SKIPPED" not in table
    saved = json.loads((out / "gpu_check.json").read_text())
    assert saved["complete"] and saved["failures"] == 0
    data = saved["data"]
    assert all(case["ok"] for case in data["kernels"]["cases"])
    assert data["engine toy"]["decode_step"]["syncs_per_step"] == 1.0
    assert data["tuning"]["table"] == str(out / "cpu.json") and (out / "cpu.json").exists()
    assert not (ROOT / "kernels" / "configs" / "cpu.json").exists()
    bench = data["engine toy"]
    assert bench["nano-vllm bench, temperature 0.6"]["output_tokens"] == \
        bench["nano-vllm bench, temperature 0.0"]["output_tokens"]
    assert (out / "logs" / "engine-toy.log").exists()


def test_the_guard_refuses_what_the_image_lacks(tmp_path):
    """The guard itself: a project file importing a package outside the list fails the run."""
    guard_dir = tmp_path / "guard"
    guard_dir.mkdir()
    (guard_dir / "sitecustomize.py").write_text(GUARD.format(root=str(tmp_path), allowed=GPU_IMAGE_PACKAGES))
    (tmp_path / "probe.py").write_text("import duckdb\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(guard_dir), str(tmp_path)]))
    proc = subprocess.run([sys.executable, "-c", "import probe"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "which the GPU image does not have" in proc.stderr


def test_the_run_stops_itself_when_the_budget_and_its_slack_are_spent():
    """The last resort above the sections' own limits: whatever the parent waits on is interrupted."""
    t0 = time.monotonic()
    with gpu_check._watchdog(0.5):
        time.sleep(30)
    assert time.monotonic() - t0 < 5
