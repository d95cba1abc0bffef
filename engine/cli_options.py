"""The engine-limit flags (vLLM names), defined once for every command that builds an engine:
run, submit, worker, bench and sweep. Unset flags stay None so EngineConfig's defaults apply."""

from __future__ import annotations

import click

ENGINE_OPTIONS = [
    click.option("--model", default="smollm2-135m", show_default=True,
                 help="Registry name, Hugging Face directory, GGUF file or Hub id."),
    click.option("--max-num-seqs", type=int, help="Sequence cap per iteration (default 128)."),
    click.option("--max-num-batched-tokens", type=int, help="Token budget per iteration (default 8192)."),
    click.option("--max-model-len", type=int, help="Prompt + output tokens per sequence."),
    click.option("--block-size", type=int, help="Tokens per KV block (default 16)."),
    click.option("--num-kv-blocks", type=int, help="KV blocks (default: from the KV memory budget)."),
    click.option("--enable-chunked-prefill/--no-enable-chunked-prefill", default=None,
                 help="Split long prompts across iterations (default on)."),
    click.option("--enable-prefix-caching", is_flag=True, default=None, help="Reuse shared prefixes' KV."),
    click.option("--scheduling-policy", type=click.Choice(["fcfs", "priority"]), help="Default fcfs."),
    click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), help="Default float32."),
    click.option("--device", help="cpu, cuda or cuda:N (default cpu)."),
]
ENGINE_FIELDS = ("model", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
                 "num_kv_blocks", "enable_chunked_prefill", "enable_prefix_caching", "scheduling_policy",
                 "dtype", "device")



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
        flag = "--" + name.replace("_", "-")
        if name == "enable_chunked_prefill":
            args.append(flag if value else "--no-enable-chunked-prefill")
        elif name == "enable_prefix_caching":
            args += [flag] if value else []
        elif value is not None:
            args += [flag, str(value)]
    return args
