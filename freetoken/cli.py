"""The `freetoken` command line: parses options, calls one library function per command.

Owns only option parsing, exit codes and the one-line error format; all work lives in the
library (ftw.convert, ftw.inspect, freetoken.api, freetoken.profile).
"""
import sys

import click

from ftw.errors import FTWError

from .errors import FreetokenError

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
    """


@main.command()
@click.argument("src_dir", type=click.Path(file_okay=False, path_type=str))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=str),
              help="Output .ftw file (written as OUT.ftw.partial, then renamed).")
@click.option("--dtype", type=click.Choice(["auto", "bf16", "fp16", "fp32"]), default="auto",
              show_default=True, help="Weight dtype in the output; auto keeps the source dtype.")
@click.option("--threads", type=click.IntRange(1, 256), default=None,
              help="Writer threads [default: number of CPU cores, at most 8].")
@click.option("--split-size", default=None, metavar="SIZE",
              help="Split the output into parts of at most SIZE (e.g. 4G) for file-size-limited hosts.")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
def convert(src_dir, output, dtype, threads, split_size, force):
    """Convert a Hugging Face safetensors checkpoint in SRC_DIR into one FTW file."""
    from ftw.convert import convert as run_convert
    run_convert(src_dir, output, dtype=dtype, threads=threads, split_size=split_size,
                force=force, progress=True)


@main.command()
@click.argument("model", type=click.Path(dir_okay=False, path_type=str))
@click.option("--verify", is_flag=True, help="Also check every tensor and expert-slot checksum.")
@click.option("--json", "as_json", is_flag=True, help="Print the header as JSON.")
def inspect(model, verify, as_json):
    """Print the header, config, tensor table and expert-bank table of MODEL.ftw."""
    from ftw.inspect import inspect_file
    click.echo(inspect_file(model, verify=verify, as_json=as_json))


def main_entry():  # pragma: no cover - console entry when called as a module
    main()


if __name__ == "__main__":  # pragma: no cover
    main()
