"""`fastln lines [FILE]`: a line-oriented LayerNorm program.

Reads commands one per line from FILE (or stdin when FILE is missing or '-')::

    INPUT v1 v2 ...   add a sample (finite numbers, separated by spaces)
    NORM              print every pending sample normalized on its own, one line per sample,
                      in input order, then forget them
    GAMMA v1 v2 ...   the scale; stays set (default: ones of the sample's length)
    BETA v1 v2 ...    the shift; stays set (default: zeros of the sample's length)
    EPS v             added to the variance; stays set (default 1e-5; must be >= 0)

Commands are case-insensitive; blank lines and lines whose first non-blank character is '#'
are ignored. Words are separated by ASCII blanks (spaces, tabs), and a value is written in the
plain ASCII decimal notation: an optional sign, digits with an optional decimal point, an
optional exponent (``-12``, ``0.5``, ``.5``, ``1e-3``, ``+2.5E+10``); no digit separators
(``1_0``) and no digits of other scripts (``١٢``), which Python's float() would take. Values
print with 4 decimals (``--precision N``), separated by single spaces; negative zero prints as
0.0000, and a constant sample prints beta, never nan.

A bad line (unknown command, missing or extra values, a value that is not a finite number, a
negative EPS, a sample whose length differs from a GAMMA or BETA that is set) prints
``line N: <what is wrong>`` on stderr and is skipped; the exit status is then 1, else 0. A
sample is checked when it is read and again at NORM, against the GAMMA and BETA in effect
then (they may have been set after it); a sample that fails at NORM is reported with the
number of its INPUT line. A word quoted in a message is cut short when it is long.

An unreadable FILE (or input) and output that cannot be written (a full disk) are exit status 2,
with a message on stderr. A reader that stops reading (``| head -1``) ends the program quietly
with status 141, as the SIGPIPE that ends other Unix programs there would; Ctrl-C ends it
quietly with status 130.

    $ printf 'INPUT 10 20 60\\nNORM\\n' | fastln lines
    -0.9258 -0.4629 1.3887
"""
import argparse
import math
import os
import re
import sys

import numpy as np

COMMANDS = ("INPUT", "NORM", "GAMMA", "BETA", "EPS")
DEFAULT_EPS = 1e-5
DEFAULT_PRECISION = 4
MAX_PRECISION = 100
MAX_SHOWN = 40          # the longest word quoted whole in a message

# ASCII only: Python's str.split and float() also take other scripts' spaces and digits.
BLANKS = re.compile(r"[ \t\r\n\v\f]+")
NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
NOT_FINITE = re.compile(r"[+-]?(?:inf|infinity|nan)", re.IGNORECASE)
STATUS_BROKEN_PIPE = 128 + 13   # what a shell reports for a program ended by SIGPIPE
STATUS_INTERRUPTED = 128 + 2    # ... and by SIGINT


class BadLine(ValueError):
    """What is wrong with one line; the message follows ``line N: ``."""


def shown(word, quoted=True):
    """A word for a message, cut short if long: quoted with repr (which escapes control
    characters), or as it is (for a word known to be a number)."""
    text = word if len(word) <= MAX_SHOWN else word[:MAX_SHOWN // 2]
    text = repr(text) if quoted else text
    return text if len(word) <= MAX_SHOWN else f"{text}... ({len(word)} characters)"


def split_words(line):
    """The words of a line, separated by ASCII blanks."""
    return [word for word in BLANKS.split(line) if word]


def parse_values(words):
    """The words of a line after its command, as floats; each must be a finite number in the
    plain ASCII decimal notation (see the module's docstring)."""
    values = []
    for word in words:
        if NOT_FINITE.fullmatch(word):
            raise BadLine(f"{shown(word)} is not a finite number")
        if not NUMBER.fullmatch(word):
            raise BadLine(f"{shown(word)} is not a number")
        value = float(word)
        if not math.isfinite(value):  # 1e999: beyond float64
            raise BadLine(f"{shown(word)} is not a finite number")
        values.append(value)
    return values


def format_values(values, precision=DEFAULT_PRECISION):
    """'-0.9258 -0.4629 1.3887': fixed decimals, single spaces, no negative zero."""
    texts = []
    for value in values:
        text = f"{value:.{precision}f}"
        if text.startswith("-") and float(text) == 0.0:  # -0.0, or -0.00001 rounded to zero
            text = text[1:]
        texts.append(text)
    return " ".join(texts)


def normalize_sample(x, gamma=None, beta=None, eps=DEFAULT_EPS):
    """y = gamma * (x - mean) / sqrt(var + eps) + beta for one sample, computed by
    fastln.layer_norm in float64.

    A constant sample has x - mean = 0 and variance 0: x_hat is 0 and the result is beta,
    even with eps = 0 (0 / 0 would be nan).

    The sample is first scaled by the power of two 2**-e that brings the larger of its largest
    |value| and sqrt(eps) into [0.5, 1), and eps by its square: x and eps are then at most 1,
    so the variance of values near 1e300 cannot overflow, nor that of subnormal values
    underflow, nor eps overflow. LayerNorm is invariant under that scaling, and it is exact
    (a value far below the largest, or eps far below the variance, may round, but below what
    the result can show), so ordinary samples get every bit of fastln.layer_norm's result.
    The factors themselves may be beyond float64 (2**1074 for the smallest subnormal): the
    exponents are applied with ldexp.
    """
    import fastln

    x = np.asarray(x, dtype=np.float64)
    gamma = np.ones_like(x) if gamma is None else np.asarray(gamma, dtype=np.float64)
    beta = np.zeros_like(x) if beta is None else np.asarray(beta, dtype=np.float64)
    if np.all(x == x[0]):
        return beta.copy()
    _, exponent = math.frexp(max(float(np.max(np.abs(x))), math.sqrt(eps)))
    with np.errstate(under="ignore"):
        scaled_x = np.ldexp(x, -exponent)
    scaled_eps = math.ldexp(eps, -2 * exponent)  # at most 1: no overflow
    return fastln.layer_norm(scaled_x, gamma, beta, scaled_eps)


class LinesProgram:
    """The program's state: pending samples, GAMMA, BETA and EPS; one call per input line.

    ``out`` receives the normalized samples, ``err`` the ``line N: ...`` messages.
    """

    def __init__(self, out, err, precision=DEFAULT_PRECISION):
        self.out = out
        self.err = err
        self.precision = precision
        self.pending = []      # (line number, values) of the samples read since the last NORM
        self.gamma = None      # (line number, values) of the last good GAMMA, or None
        self.beta = None
        self.eps = DEFAULT_EPS
        self.bad_lines = 0

    def report(self, line_number, message):
        self.out.flush()  # keep stdout and stderr in order on a terminal
        print(f"line {line_number}: {message}", file=self.err)
        self.bad_lines += 1

    def feed(self, line_number, line):
        """Run one input line; a bad line is reported and changes nothing."""
        if line_number == 1:  # a byte-order mark (from a Windows editor) is not a command
            line = line.removeprefix("\ufeff")
        words = split_words(line)
        if not words or words[0].startswith("#"):
            return
        # ASCII letters only: "ınput".upper() (a dotless i) is "INPUT" too.
        command = words[0].upper() if words[0].isascii() else words[0]
        arguments = words[1:]
        try:
            if command not in COMMANDS:
                raise BadLine(f"unknown command {shown(words[0])} (expected one of "
                              f"{', '.join(COMMANDS)})")
            getattr(self, "command_" + command.lower())(line_number, arguments)
        except BadLine as problem:
            self.report(line_number, str(problem))

    def finish(self):
        """At the end of the input: warn about samples no NORM printed."""
        if self.pending:
            numbers = ", ".join(str(line_number) for line_number, _ in self.pending)
            self.out.flush()
            print(f"fastln lines: warning: {len(self.pending)} sample(s) (line(s) {numbers}) "
                  "were never normalized: no NORM after them", file=self.err)

    # -- the commands ------------------------------------------------------------------------

    def mismatch(self, values):
        """Why `values` cannot be normalized with the GAMMA and BETA that are set, or None."""
        for name, setting in (("GAMMA", self.gamma), ("BETA", self.beta)):
            if setting is not None and len(setting[1]) != len(values):
                return (f"{len(values)} value(s), but {name} (set on line {setting[0]}) has "
                        f"{len(setting[1])}")
        return None

    def command_input(self, line_number, arguments):
        if not arguments:
            raise BadLine("INPUT needs at least one value")
        values = parse_values(arguments)
        problem = self.mismatch(values)
        if problem:
            raise BadLine(f"the sample has {problem}")
        self.pending.append((line_number, values))

    def command_norm(self, line_number, arguments):
        if arguments:
            raise BadLine(f"NORM takes no values, got {len(arguments)}")
        gamma = None if self.gamma is None else self.gamma[1]
        beta = None if self.beta is None else self.beta[1]
        for sample_line, values in self.pending:
            problem = self.mismatch(values)
            if problem:
                self.report(sample_line, f"the sample has {problem}; skipped by NORM on line "
                                         f"{line_number}")
                continue
            y = normalize_sample(values, gamma, beta, self.eps)
            if not np.all(np.isfinite(y)):
                self.report(sample_line, "the normalized sample overflows float64 (GAMMA or "
                                         f"BETA too large); skipped by NORM on line "
                                         f"{line_number}")
                continue
            print(format_values(y, self.precision), file=self.out)
        self.pending = []
        self.out.flush()  # a NORM typed at a terminal answers at once

    def command_gamma(self, line_number, arguments):
        if not arguments:
            raise BadLine("GAMMA needs at least one value")
        self.gamma = (line_number, parse_values(arguments))

    def command_beta(self, line_number, arguments):
        if not arguments:
            raise BadLine("BETA needs at least one value")
        self.beta = (line_number, parse_values(arguments))

    def command_eps(self, line_number, arguments):
        if len(arguments) != 1:
            raise BadLine(f"EPS takes exactly one value, got {len(arguments)}")
        (eps,) = parse_values(arguments)
        if eps < 0:
            raise BadLine(f"EPS must be >= 0, got {shown(arguments[0], quoted=False)}")
        self.eps = eps


def run_lines(lines, out=None, err=None, precision=DEFAULT_PRECISION):
    """Run the program over an iterable of lines; returns the exit status (1 if a line was bad)."""
    program = LinesProgram(out or sys.stdout, err or sys.stderr, precision)
    for line_number, line in enumerate(lines, start=1):
        program.feed(line_number, line)
    program.finish()
    return 1 if program.bad_lines else 0


def _precision(text):
    if not re.fullmatch(r"[0-9]{1,4}", text) or int(text) > MAX_PRECISION:  # ASCII digits
        raise argparse.ArgumentTypeError(
            f"expected a number of decimals from 0 to {MAX_PRECISION}, got {shown(text)}")
    return int(text)


def add_arguments(parser):
    parser.description = (
        "A line-oriented LayerNorm program: INPUT v... adds a sample, NORM prints each pending "
        "sample normalized on its own and clears them, GAMMA v... / BETA v... / EPS v set the "
        "parameters (they stay set). Commands are case-insensitive; '#' starts a comment line. "
        "Bad lines are reported on stderr as 'line N: ...' and skipped (exit status 1).")
    parser.epilog = "example: printf 'INPUT 10 20 60\\nNORM\\n' | fastln lines"
    parser.add_argument("file", nargs="?", default="-", metavar="FILE",
                        help="the commands (default: stdin; '-' is stdin too)")
    parser.add_argument("--precision", type=_precision, default=DEFAULT_PRECISION, metavar="N",
                        help=f"decimals printed (default: {DEFAULT_PRECISION})")


class UnreadableInput(Exception):
    """Reading the input failed (an OSError while reading, not while writing)."""


def _read(lines):
    """The lines of the input; a failure to read them is an UnreadableInput."""
    try:
        yield from lines
    except OSError as exc:
        raise UnreadableInput(exc.strerror or str(exc)) from None


def _discard_stdout():
    """Point stdout's file descriptor at /dev/null: what the program could not write would
    otherwise be written again, and fail again, when Python flushes stdout at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # a stdout without a descriptor (a test's)
        pass


def _complain(message):
    try:
        print(f"fastln lines: {message}", file=sys.stderr)
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # stderr unwritable too: the status says it
        pass


def run(args):
    if args.file == "-":
        name = "stdin"
        if hasattr(sys.stdin, "reconfigure"):
            # Undecodable bytes: a bad line, not a crash. Universal newlines, as a file opened
            # by name reads them: a lone \r (old Mac text) ends a line too.
            sys.stdin.reconfigure(errors="replace", newline=None)
        file = sys.stdin
    else:
        name = args.file
        try:
            # utf-8-sig: a byte-order mark from a Windows editor is not part of the first line
            file = open(args.file, encoding="utf-8-sig", errors="replace")
        except OSError as exc:
            _complain(f"cannot read {args.file}: {exc.strerror or exc}")
            return 2
    try:
        try:
            return run_lines(_read(file), sys.stdout, sys.stderr, args.precision)
        finally:
            if file is not sys.stdin:
                file.close()
    except UnreadableInput as problem:
        _complain(f"cannot read {name}: {problem}")
        return 2
    except BrokenPipeError:  # the reader is gone (| head -1): nothing more to say
        _discard_stdout()
        return STATUS_BROKEN_PIPE
    except OSError as exc:  # writing stdout or stderr failed (a full disk, ...)
        _discard_stdout()
        _complain(f"cannot write the output: {exc.strerror or exc}")
        return 2
    except KeyboardInterrupt:
        return STATUS_INTERRUPTED
