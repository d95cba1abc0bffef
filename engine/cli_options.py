"""The engine-limit flags (vLLM names), defined once for every command that builds an engine:
run, submit, worker, bench and sweep. Unset flags stay None so EngineConfig's defaults apply."""

from __future__ import annotations

import click

ENGINE_OPTIONS = [
    click.option("--model", default="smollm2-135m", show_default=True,
                 help="Registry name, Hugging Face directory, GGUF file or Hub id."),
    click.option("--max-num-seqs", type=int,
                 help="Sequence cap per iteration (default 128 on CPU, 256 on CUDA)."),
    click.option("--max-num-batched-tokens", type=int,
                 help="Token budget per iteration (default 8192 on CPU, 16384 on CUDA)."),
    click.option("--max-model-len", type=int, help="Prompt + output tokens per sequence."),
    click.option("--block-size", type=int, help="Tokens per KV block (default 16)."),
    click.option("--num-kv-blocks", type=int, help="KV blocks (default: sized from memory, see below)."),
    click.option("--gpu-memory-utilization", type=float,
                 help="CUDA: share of the GPU's memory for weights, activations and KV (default 0.9)."),
    click.option("--kv-cache-memory", "kv_cache_memory_gb", type=float,
                 help="CPU: GiB for the KV cache (default: a share of the free RAM)."),
    click.option("--enable-chunked-prefill/--no-enable-chunked-prefill", default=None,
                 help="Split long prompts across iterations (default on)."),
    click.option("--enable-prefix-caching", is_flag=True, default=None, help="Reuse shared prefixes' KV."),
    click.option("--scheduling-policy", type=click.Choice(["fcfs", "priority"]), help="Default fcfs."),
    click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]),
                 help="auto (default): float32 on CPU, bfloat16 on CUDA."),
    click.option("--device", help="cpu, cuda or cuda:N (default cpu)."),
    click.option("--enforce-eager", is_flag=True, default=None,
                 help="No CUDA graphs (and no padded decode buckets on CPU): every step runs eagerly."),
]
ENGINE_FIELDS = ("model", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
                 "num_kv_blocks", "gpu_memory_utilization", "kv_cache_memory_gb", "enable_chunked_prefill",
                 "enable_prefix_caching", "scheduling_policy", "dtype", "device", "enforce_eager")
FLAG_NAMES = {"kv_cache_memory_gb": "--kv-cache-memory"}  # where the flag is not the field's name



def engine_options(f):
    """Decorate a click command with every engine flag."""
    for option in reversed(ENGINE_OPTIONS):
        f = option(f)
    return f


def engine_config(opts: dict):
    """An EngineConfig from the engine flags given; a bad value is a usage error naming the flag."""
    from engine.config import EngineConfig

    given = {k: opts[k] for k in ENGINE_FIELDS if opts.get(k) is not None}
    try:
        return EngineConfig(**given)
    except ValueError as exc:
        raise click.UsageError(f"engine flags: {exc}") from None


def engine_flags(config) -> list[str]:
    """The `batchgen worker` flags that rebuild `config` (for worker subprocesses)."""
    args = []
    for name in ENGINE_FIELDS:
        value = getattr(config, name)
        flag = FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
        if name == "enable_chunked_prefill":
            args.append(flag if value else "--no-enable-chunked-prefill")
        elif name in ("enable_prefix_caching", "enforce_eager"):
            args += [flag] if value else []
        elif value is not None:
            args += [flag, str(value)]
    return args
