"""The `freetoken` command line: parses options, calls one library function per command.

Owns only option parsing, exit codes and the one-line error format; all work lives in the
library (ftw.convert, ftw.inspect, freetoken.api, freetoken.chat, freetoken.server,
freetoken.profile, freetoken.bench).
"""
import logging
import sys

import click

from ftw.errors import FTWError

from .errors import ConfigError, FreetokenError
from .kernel_args import KERNEL_QUANTS

EXIT_USAGE = 2


class _Group(click.Group):
    """Turns library errors into `error: <message>` + exit 2, and Ctrl-C into exit 130."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (FreetokenError, FTWError) as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(EXIT_USAGE)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="freetoken")
def main():
    """freetoken: run Mixture-of-Experts models larger than your GPU.

    \b
      freetoken convert ./Qwen3-30B-A3B -o qwen3.ftw   # HF safetensors -> FTW, once
      freetoken inspect qwen3.ftw                       # what is inside a .ftw file
      freetoken profile                                 # measure PCIe / CPU bandwidth, once
      freetoken run qwen3.ftw -p "Explain PCIe"         # generate text
      freetoken run -p "def fibonacci(n):"              # the bundled tiny model
      freetoken chat qwen3.ftw                          # a multi-turn chat
      freetoken serve qwen3.ftw --port 8080             # OpenAI + Anthropic HTTP APIs
      freetoken bench qwen3.ftw --expert-cache-gb 4,8   # prompt and generation tok/s, llama-bench style
    """


@main.command()
@click.argument("src_dir", type=click.Path(file_okay=False, path_type=str))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=str),
              help="Output .ftw file (written as OUT.ftw.partial, then renamed).")
@click.option("--dtype", type=click.Choice(["auto", "bf16", "fp16", "fp32"]), default="auto",
              show_default=True, help="Weight dtype in the output; auto keeps the source dtype.")
@click.option("--quant", type=click.Choice(["none", "q8_0", "q4_0", "mxfp4", "nvfp4", "fp8_e4m3"]), default="none",
              show_default=True, help="Quantize the routed experts (ftw/SPEC.md §9): q8_0 8-bit, "
              "q4_0 / mxfp4 / nvfp4 4-bit (int4 groups of 32, e2m1 with a power-of-two scale per 32, "
              "e2m1 with an e4m3 scale per 16), fp8_e4m3 8-bit (e4m3 with an fp32 scale per 128 x 128 "
              "tile); every other tensor keeps --dtype, which stays the experts' compute dtype. "
              "Published MXFP4 (gpt-oss) and FP8 (DeepSeek-V3, Qwen) experts are copied as they are.")
@click.option("--threads", type=click.IntRange(1, 256), default=None,
              help="Writer threads [default: CPU cores, between 4 and 8].")
@click.option("--split-size", default=None, metavar="SIZE",
              help="Split the output into parts of at most SIZE (e.g. 4G) for file-size-limited hosts.")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
def convert(src_dir, output, dtype, quant, threads, split_size, force):
    """Convert a Hugging Face safetensors checkpoint in SRC_DIR into one FTW file."""
    from ftw.convert import convert as run_convert
    run_convert(src_dir, output, dtype=dtype, threads=threads, split_size=split_size,
                force=force, progress=True, quant=quant)


@main.command()
@click.argument("model", type=click.Path(dir_okay=False, path_type=str))
@click.option("--verify", is_flag=True, help="Also check every tensor and expert-slot checksum.")
@click.option("--json", "as_json", is_flag=True, help="Print the header as JSON.")
def inspect(model, verify, as_json):
    """Print the header, config, tensor table and expert-bank table of MODEL.ftw."""
    from ftw.inspect import inspect_file
    click.echo(inspect_file(model, verify=verify, as_json=as_json))


def _options(*decorators):
    """One decorator applying click options in the order given (shared by run and chat)."""
    def apply(f):
        for decorator in reversed(decorators):
            f = decorator(f)
        return f
    return apply


# NOTE: these defaults repeat those of SamplingParams / EngineConfig (importing them here would
# import torch for every `--help`); tests/test_cli_run.py checks that they agree.
SAMPLING_OPTIONS = _options(
    click.option("-n", "--n-predict", "max_tokens", type=int, default=256,
                  help="Maximum number of tokens to generate (>= 1)."),
    click.option("--temp", "temperature", type=float, default=0.8,
                  help="Sampling temperature (>= 0); 0 is greedy (always the most likely token)."),
    click.option("--top-k", type=int, default=40, help="Keep only the K most likely tokens (0 = off)."),
    click.option("--top-p", type=float, default=0.95,
                  help="Keep the smallest set of tokens whose probability reaches P (0 < P <= 1; 1 = off)."),
    click.option("--min-p", type=float, default=0.05,
                  help="Drop tokens less likely than MIN_P x the top token's probability (0 = off)."),
    click.option("--repeat-penalty", "repetition_penalty", type=float, default=1.0,
                  help="Divide the logits of tokens already in the context by this (> 0; 1 = off)."),
    click.option("--seed", type=int, default=None,
                  help="Random seed; the same seed, prompt and options give the same text.  [default: random]"),
    click.option("--stop", multiple=True, metavar="STR",
                  help="Stop when the output contains STR (not printed); repeat for several."),
)
ENGINE_OPTIONS = _options(
    click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto",
                  help="Compute device; auto = cuda when a GPU is visible. On cpu the expert cache "
                       "is a separate CPU tier (same cache, plan and fills)."),
    click.option("--dtype", type=click.Choice(["auto", "bf16", "fp16", "fp32"]), default="auto",
                  help="Compute dtype; auto = bf16 on cuda, fp32 on cpu."),
    click.option("--expert-cache-gb", type=float, default=None,
                  help="Device expert cache size in GB (at most the model's experts).  "
                       "[default: what the context leaves on the GPU (the memory plan); 0 on cpu "
                       "unless --gpu-mem-gb]"),
    click.option("--expert-cache-frac", type=float, default=None,
                  help="Device expert cache as a fraction 0..1 of all experts (instead of --expert-cache-gb)."),
    click.option("--gpu-mem-gb", type=float, default=None,
                  help="Cap on all the engine takes on the GPU in GB (weights, KV, buffers, expert "
                       "cache), to leave room for other programs; on cpu, on the host RAM of the "
                       "device part, with the expert cache taking what the context leaves.  "
                       "[default: the free GPU memory]"),
    click.option("--policy", type=click.Choice(["hybrid", "offload", "cpu"]), default="hybrid",
                  help="Decode cache misses: hybrid splits them between PCIe fills and CPU experts "
                       "by measured bandwidth (`freetoken profile`); offload fills all; cpu runs all on the CPU."),
    click.option("--ctx-size", type=int, default=4096,
                  help="Context length of one sequence in tokens (prompt + generated)."),
    click.option("--parallel", type=int, default=4,
                  help="Sequences at once; the KV pool holds --ctx-size x this unless --kv-tokens."),
    click.option("--kv-tokens", type=int, default=None,
                  help="Tokens of the KV page pool (shared by the sequences and the prefix cache).  "
                       "[default: --ctx-size x --parallel]"),
    click.option("--prefix-cache/--no-prefix-cache", default=True, show_default=True,
                  help="Keep finished sequences' KV pages so that a later prompt with the same "
                       "prefix prefills only the rest."),
    click.option("--state-checkpoints/--no-state-checkpoints", default=True, show_default=True,
                  help="Models with linear-attention layers (qwen3_next, qwen3_5_moe_text): keep "
                       "their recurrent state in the prefix cache after each block-closing token "
                       "(reasoning, tool call, tool output, turn), so that a prompt sharing a "
                       "prefix prefills from there; --no-state-checkpoints: no prefix cache for them."),
    click.option("--state-interval", type=int, default=2048, show_default=True,
                  help="Also keep the state every this many tokens inside a longer span "
                       "(re-prefill after an edit inside it is at most this many tokens)."),
    click.option("--state-budget", type=int, default=None, metavar="BYTES",
                  help="Bytes of kept states; beyond it the least recently used go.  "
                       "[default: 10 states of the model per --parallel sequence]"),
    click.option("--prefill-chunk", type=int, default=None,
                  help="Prompt tokens per forward pass during prefill.  [default: 8192 on "
                       "cuda, where a streamed forward costs about the same at any length; 512 "
                       "on cpu]"),
    click.option("--cpu-threads", type=int, default=None,
                  help="Threads for CPU experts.  [default: physical cores]"),
    click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True,
                  help="Replay decode steps from captured CUDA graphs (cuda only; --no-cuda-graphs "
                       "launches every kernel from Python, slower, for comparison and debugging)."),
    click.option("--fill-behind", type=click.IntRange(0, 64), default=None, metavar="N",
                  help="In every MoE layer step, also copy up to N of the experts it ran on the CPU "
                       "into the expert cache, for later tokens, by a background copy that yields "
                       "the PCIe link to the step's own fills; 0 turns it off.  [default: 1 in steps "
                       "of at most 3 cache misses with --policy hybrid on a GPU with Triton, else 0]"),
    click.option("--memory-watch/--no-memory-watch", default=True, show_default=True,
                  help="Between steps (every 100 ms at most), check the device's free memory (cuda: "
                       "the GPU's; cpu: the host's available RAM); when another program leaves less "
                       "than the memory plan's margin, shrink the expert cache by what is missing, "
                       "and grow it back toward its planned size when memory returns. Each resize "
                       "prints one line."),
    click.option("--kv-grow/--no-kv-grow", default=True, show_default=True,
                  help="When a request waits only for KV pages (--kv-tokens below --ctx-size x "
                       "--parallel), grow the page pool by what it lacks, taking the memory from "
                       "the expert cache, and give it back to the cache once the added pages are "
                       "free again. Each resize prints one line."),
)
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                   "seed", "stop")


def _echo_plan(plan, notes=()) -> None:
    """The memory plan's block on stderr, then the engine's notes (Engine.notes); the expert
    cache's resize lines follow them there."""
    for line in plan.lines():
        click.echo(line, err=True)
    for note in notes:
        click.echo(f"freetoken: {note}", err=True)
    _echo_resizes()


class _EchoHandler(logging.Handler):
    """A log record as one `freetoken: ...` line on stderr (click's stderr of the moment)."""

    def emit(self, record):
        click.echo(f"freetoken: {self.format(record)}", err=True)


def _echo_resizes() -> None:
    """The expert cache's resize lines (memory_watch.py's logger) to stderr, once per process."""
    logger = logging.getLogger("freetoken.memory")
    if not any(isinstance(h, _EchoHandler) for h in logger.handlers):
        logger.addHandler(_EchoHandler())
        logger.setLevel(logging.INFO)


def _split_options(options: dict):
    """(SamplingParams, EngineConfig) from a command's sampling and engine options."""
    from .api import engine_config
    from .sampling import SamplingParams
    sampling = {k: options.pop(k) for k in SAMPLING_FIELDS}
    return SamplingParams(**sampling), engine_config(**options)


@main.command(context_settings={"show_default": True})
@click.argument("model", required=False, type=click.Path(dir_okay=False, path_type=str))
@click.option("-p", "--prompt", required=True,
              help="Prompt text; '-' reads it from stdin.")
@click.option("--raw", is_flag=True,
              help="Send the prompt as is, without the model's chat template.")
@click.option("--stats", is_flag=True,
              help="Also print every expert-runtime counter after the timing lines.")
@click.option("--trace-out", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Record the routed expert ids of every token and MoE layer to FILE (a numpy .npz).")
@SAMPLING_OPTIONS
@ENGINE_OPTIONS
def run(model, prompt, raw, stats, trace_out, **options):
    """Generate text from PROMPT with MODEL.ftw (no MODEL: the small bundled model).

    Streams the text to stdout; timing and expert-cache lines go to stderr at the end.
    """
    from .api import LLM

    if prompt == "-":
        prompt = sys.stdin.read()
    params, config = _split_options(dict(options, trace_out=trace_out))
    with LLM(model, config=config) as llm:
        pieces = llm.stream(prompt, params, chat=not raw)  # a bad prompt raises here
        _echo_plan(llm.engine.memory_plan, llm.engine.notes)
        for piece in pieces:
            click.echo(piece, nl=False)  # flushes: text appears as it is generated
        click.echo()
        for line in llm.stats.lines(detail=stats):
            click.echo(line, err=True)


@main.command(context_settings={"show_default": True})
@click.argument("model", required=False, type=click.Path(dir_okay=False, path_type=str))
@click.option("--system", default=None, help="A system message that opens the conversation.")
@SAMPLING_OPTIONS
@ENGINE_OPTIONS
def chat(model, system, **options):
    """Chat with MODEL.ftw (no MODEL: the small bundled model) through its chat template.

    \b
    The conversation stays in the prefix cache: each turn prefills only its new tokens.
    On a terminal: line editing and history; /reset, /stats, /exit; Ctrl-C stops a reply.
    Otherwise each input line is one turn (or command); each reply is printed followed by
    a blank line.
    """
    from .api import LLM
    from .chat import ChatSession, run_interactive, run_scripted

    params, config = _split_options(options)
    with LLM(model, config=config) as llm:
        _echo_plan(llm.engine.memory_plan, llm.engine.notes)
        session = ChatSession(llm, params, system)
        if sys.stdin.isatty() and sys.stdout.isatty():
            run_interactive(session, sys.stdout)
        else:
            run_scripted(session, sys.stdin, sys.stdout)

# NOTE: serve's listening defaults repeat ServeConfig's (server/config.py); test_server_cli checks.
@main.command(context_settings={"show_default": True})
@click.argument("model", required=False, type=click.Path(dir_okay=False, path_type=str))
@click.option("--host", default="127.0.0.1",
              help="Address to listen on; 0.0.0.0 opens it to the network (set --api-key).")
@click.option("--port", type=int, default=8080, help="Port to listen on.")
@click.option("--api-key", default=None,
              help="Key clients must send (`Authorization: Bearer KEY` or `x-api-key: KEY`); "
                   "/health stays open.  [default: $FREETOKEN_API_KEY, else none]")
@click.option("--max-queue", type=int, default=64,
              help="Requests admitted at once (running + waiting); more get 503 until one ends.")
@click.option("--max-body-mb", type=float, default=32.0,
              help="Largest request body in MB; larger ones get 413.")
@click.option("--model-name", default=None,
              help="The model id clients see (/v1/models).  [default: MODEL's file name]")
@ENGINE_OPTIONS
def serve(model, host, port, api_key, max_queue, max_body_mb, model_name, **options):
    """Serve MODEL.ftw over OpenAI- and Anthropic-compatible HTTP APIs (no MODEL: the bundled one).

    \b
    OpenAI:    GET /v1/models, POST /v1/chat/completions, POST /v1/completions,
               POST /v1/responses (stateless)
    Anthropic: POST /v1/messages, POST /v1/messages/count_tokens
    Also:      GET /health, GET /metrics (Prometheus), POST /tokenize, POST /detokenize
    Admin:     POST /admin/expert-cache {"gb": N}: resize the expert cache between steps
    """
    from .api import engine_config, plan_model
    from .config import env
    from .server.config import ServeConfig
    from .server.serve import serve as run_server

    config = ServeConfig(host=host, port=port, api_key=api_key or env("FREETOKEN_API_KEY") or None,
                         max_queue=max_queue, max_body_mb=max_body_mb, model_name=model_name)
    engine = engine_config(**options)
    # the plan the engine makes at load, printed (or refused) before serve listens
    _echo_plan(plan_model(model, engine))
    run_server(model, engine, config, echo=lambda line: click.echo(line, err=True))


# NOTE: bench's grid options are strings parsed by freetoken.bench, so that a bad value is the
# one-line `error:` (exit 2) of every library error rather than click's usage text.
@main.command(context_settings={"show_default": True})
@click.argument("model", required=False, type=click.Path(dir_okay=False, path_type=str))
@click.option("-p", "--n-prompt", default="512,8192", metavar="N[,N...]",
              help="Prompt processing tests: prefill rate of a cold prompt of N random tokens, "
                   "one test per value (0 = none).")
@click.option("-n", "--n-gen", default="128", metavar="N[,N...]",
              help="Token generation tests: decode rate of N tokens after a one-token prompt, EOS "
                   "ignored, one test per value (0 = none).")
@click.option("--expert-cache-gb", default=None, metavar="GB[,GB...]",
              help="Device expert cache sizes to measure, one grid row set per value.  "
                   "[default: the engine's default size]")
@click.option("--expert-cache-frac", default=None, metavar="F[,F...]",
              help="Expert cache sizes as fractions 0..1 of all experts, measured after the "
                   "--expert-cache-gb values.")
@click.option("--policy", default="hybrid", metavar="P[,P...]",
              help="Miss policies to measure: hybrid, offload, cpu (see `freetoken run --help`).")
@click.option("--parallel", default="1", metavar="B[,B...]",
              help="Sequences decoding together in the -n tests, one test per value: the row's "
                   "rate is their aggregate tokens per second (pp tests run one sequence).")
@click.option("-r", "--repetitions", default="5", metavar="N",
              help="Timed runs per test, after one untimed warm-up; rows give their mean and "
                   "standard deviation.")
@click.option("-o", "--output", "fmt", default="md", metavar="md|json|csv",
              help="md: a markdown table and the build/device/CPU line; json: a list of rows; "
                   "csv: a header and a line per row (rows carry the build/device/CPU fields).")
@click.option("--device", default="auto", metavar="auto|cuda|cpu",
              help="Compute device; auto = cuda when a GPU is visible.")
@click.option("--dtype", default="auto", metavar="auto|bf16|fp16|fp32",
              help="Compute dtype; auto = bf16 on cuda, fp32 on cpu.")
@click.option("--gpu-mem-gb", type=float, default=None,
              help="Cap on all the engine takes on the GPU in GB (see `freetoken run --help`).  "
                   "[default: the free GPU memory]")
@click.option("--cpu-threads", type=int, default=None,
              help="Threads for CPU experts.  [default: physical cores]")
@click.option("--prefill-chunk", type=int, default=None,
              help="Prompt tokens per forward pass during prefill.  [default: 8192 on cuda, "
                   "512 on cpu]")
def bench(model, n_prompt, n_gen, expert_cache_gb, expert_cache_frac, policy, parallel,
          repetitions, fmt, **options):
    """Measure prompt processing and token generation rates of MODEL.ftw (no MODEL: the
    bundled one) over a grid of expert-cache sizes and policies, like llama-bench.

    \b
    Every cache size x policy loads the model once (prefix cache and memory watch off) and runs
    each -p and -n test once to warm up, then -r times; the rates are the engine's own prefill
    and decode timings (those `run` prints). Rows also give the expert hit rate and the bytes
    filled per run. The developer benches are in tools/.
    """
    from .api import default_model_path, engine_config
    from .bench import FORMATS, make_config, report, run_bench

    if fmt not in FORMATS:
        raise ConfigError(f"-o/--output takes {', '.join(FORMATS)}, not {fmt!r}")
    config = make_config(n_prompt, n_gen, expert_cache_gb, expert_cache_frac, policy,
                         repetitions, parallel)
    base = engine_config(**options)
    config.cell_configs(base)  # every cell valid before anything loads
    report(run_bench(model or default_model_path(), config, base), fmt, click.echo)

@main.command()
@click.option("--model", type=click.Path(exists=True, dir_okay=False, path_type=str), default=None,
              help="Measure on this model's expert shape [default: Qwen3-30B-A3B's, 2048/768 bf16 top-8].")
@click.option("--cpu-threads", type=click.IntRange(1, 1024), default=None,
              help="CPU expert pool threads [default: physical cores, minus one with a GPU].")
@click.option("--json", "as_json", is_flag=True, help="Print the profile as JSON.")
@click.option("--quant", type=click.Choice(["none", *KERNEL_QUANTS]), default=None,
              help="Measure experts of this quant type (synthetic experts quantized as `convert "
                   "--quant TYPE` writes them; none: unquantized) on the shape of --model or the "
                   "default one, for runs of models of that type  [default: the --model's type, "
                   "else none].")
def profile(model, cpu_threads, as_json, quant):
    """Measure PCIe fill and CPU expert bandwidths on this machine and store them for `run`.

    \b
    Measured, each alone and then the fills and the CPU kernel at the same time:
      B_P  pinned host-to-device copies (one expert slot, one whole layer) and, with Triton,
           the zero-copy gather kernel that captured decode steps fill with
      B_H  the CPU expert kernel at batch 1 over a working set larger than the last-level cache
      a STREAM-like host read (the kernel's bound)
    `run` splits each layer's cache misses as q* = m x P / (P + C), P and C measured at the same
    time for the fill path it uses; without a profile it says so and uses defaults. Takes
    about half a minute; the profile is stored under the XDG cache directory, keyed by GPU,
    CPU, thread count, expert shape and quant type: a quantized model's run takes its type's
    profile, else bf16's with the CPU kernel's C scaled (it says so)."""
    from .profile import run_profile
    click.echo(run_profile(model=model, cpu_threads=cpu_threads, as_json=as_json, quant=quant))


if __name__ == "__main__":  # pragma: no cover
    main()
