"""The `fastln` command. Alone it describes this build; subcommands do the work.

A subcommand is a module with two functions, listed in SUBCOMMANDS:
    add_arguments(parser)   declare its options on the parser argparse made for it
    run(args) -> int        do the work, return the exit status
so a new one (say `fastln lines`) is one module and one line here.
"""
import argparse
import importlib
import shlex
import sys

# name: (module, one-line help)
SUBCOMMANDS = {
    "bench": ("fastln.bench.command",
              "time fastln against NumPy, PyTorch and ONNX Runtime on this machine"),
    "lines": ("fastln.lines", "normalize samples given as INPUT/NORM lines"),
}

WORKED_EXAMPLE = [10.0, 20.0, 60.0]


def build_parser():
    from fastln import __version__

    parser = argparse.ArgumentParser(
        prog="fastln",
        description="fastln: fast, exact LayerNorm for NumPy arrays. Without a subcommand, "
                    "describe this build and run the worked example.")
    parser.add_argument("--version", action="version", version=f"fastln {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        subparser = subparsers.add_parser(name, help=help_text)
        importlib.import_module(module_name).add_arguments(subparser)
    return parser


def describe(file=None):
    """show_config() and the worked example x = [10, 20, 60], computed by this build."""
    import numpy as np

    import fastln

    file = file or sys.stdout
    fastln.show_config(file=file)
    x = np.array(WORKED_EXAMPLE)
    y = fastln.layer_norm(x)
    print(f"\nworked example: x = [{', '.join(f'{v:g}' for v in x)}]  "
          f"(mean {x.mean():g}, variance {x.var():.2f}, eps 1e-5)", file=file)
    print(f"  fastln.layer_norm(x) = [{' '.join(f'{v:.4f}' for v in y)}]", file=file)
    print("\ncommands:", file=file)
    for name, (_, help_text) in SUBCOMMANDS.items():
        print(f"  fastln {name:<8} {help_text}  (fastln {name} --help)", file=file)


def main(argv=None):
    """Entry point of the `fastln` console script and of `python -m fastln`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command is None:
        describe()
        return 0
    args.argv = argv
    args.command_line = shlex.join(["fastln"] + argv)
    module_name, _ = SUBCOMMANDS[args.command]
    return importlib.import_module(module_name).run(args)


if __name__ == "__main__":
    sys.exit(main())
