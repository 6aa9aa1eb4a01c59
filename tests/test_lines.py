"""`fastln lines`: the program, its output format, every bad-line case, stdin and files, and
hostile input and output."""
import contextlib
import io
import os
import subprocess
import sys

import numpy as np
import pytest

from fastln import cli
from fastln.lines import format_values, normalize_sample, run_lines


def run(text, precision=4):
    """run_lines over `text`: (exit status, stdout lines, stderr lines)."""
    out, err = io.StringIO(), io.StringIO()
    status = run_lines(io.StringIO(text), out, err, precision)
    return status, out.getvalue().splitlines(), err.getvalue().splitlines()


def run_main(argv, stdin_text=None, monkeypatch=None):
    """cli.main in-process: (exit status, stdout, stderr)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    if stdin_text is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin_text))
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = cli.main(argv)
    return status, stdout.getvalue(), stderr.getvalue()


# ---------------------------------------------------------------------------------------------
# The worked example
# ---------------------------------------------------------------------------------------------

def test_the_worked_example():
    assert run("INPUT 10 20 60\nNORM\n") == (0, ["-0.9258 -0.4629 1.3887"], [])


def test_scaling_and_shifting_a_sample_does_not_move_the_output():
    status, out, err = run("INPUT 10 20 60\nINPUT 100 200 600\nINPUT 1010 1020 1060\nNORM\n")
    assert (status, err) == (0, [])
    assert out == ["-0.9258 -0.4629 1.3887"] * 3


def test_each_pending_sample_is_normalized_on_its_own_in_input_order_then_cleared():
    status, out, err = run("INPUT 1 2 3\nINPUT 4 4 8 8\nNORM\nNORM\nINPUT 0 1\nNORM\n")
    assert (status, err) == (0, [])
    assert out == ["-1.2247 0.0000 1.2247", "-1.0000 -1.0000 1.0000 1.0000", "-1.0000 1.0000"]


def test_gamma_beta_and_eps_stay_set():
    status, out, err = run("GAMMA 2 1 0.5\nBETA 1 0 -1\nINPUT 10 20 60\nNORM\n"
                           "INPUT 10 20 60\nNORM\nEPS 100\nINPUT 10 20 60\nNORM\n")
    assert (status, err) == (0, [])
    x_hat = np.array([10.0, 20.0, 60.0]) - 30.0
    expected = [2, 1, 0.5] * (x_hat / np.sqrt(1400 / 3 + 100)) + [1, 0, -1]
    assert out == ["-0.8516 -0.4629 -0.3056"] * 2 + [format_values(expected)]


def test_a_constant_sample_prints_beta_never_nan_even_with_eps_zero():
    status, out, err = run("INPUT 5 5 5\nNORM\nBETA 1 -2 0.5\nEPS 0\nINPUT 0.1 0.1 0.1\n"
                           "INPUT 7 7 7\nNORM\nBETA 4\nINPUT 3\nNORM\n")
    assert (status, err) == (0, [])
    assert out == ["0.0000 0.0000 0.0000", "1.0000 -2.0000 0.5000", "1.0000 -2.0000 0.5000",
                   "4.0000"]


def test_negative_zero_prints_as_zero():
    # -0.00001 rounds to "-0.0000" in Python's formatting; the program prints 0.0000
    assert format_values([-0.0, -0.00001, 0.00004, -0.00005]) == "0.0000 0.0000 0.0000 -0.0001"
    status, out, _ = run("BETA -0.00001 0 0\nINPUT 1 1 1\nNORM\n")
    assert out == ["0.0000 0.0000 0.0000"] and "-" not in out[0]


def test_comments_blank_lines_and_case_insensitive_commands():
    text = ("# the worked example\n\n   \n  # indented comment\ninput 10 20 60\n"
            "Norm\n\tGaMmA 1 1 1\r\nInPuT 10 20 60\r\nnorm\r\n")
    assert run(text) == (0, ["-0.9258 -0.4629 1.3887"] * 2, [])


@pytest.mark.parametrize("precision, expected", [
    (0, "-1 0 1"), (2, "-0.93 -0.46 1.39"), (6, "-0.925820 -0.462910 1.388730")])
def test_precision(precision, expected):
    assert run("INPUT 10 20 60\nNORM\n", precision)[1] == [expected]
    assert run("INPUT -1 0 1\nEPS 0\nNORM\n", 0)[1] == ["-1 0 1"]  # "-0" never printed


def test_extreme_but_finite_values_do_not_overflow():
    status, out, err = run("INPUT 1e308 -1e308 5e307\nINPUT 1e-300 3e-300\nEPS 0\n"
                           "INPUT 1e-300 3e-300\nNORM\n")
    assert (status, err) == (0, [])
    # eps = 0 applies at NORM to all three samples; with eps = 0 tiny values normalize too
    assert out == ["0.9806 -1.3728 0.3922", "-1.0000 1.0000", "-1.0000 1.0000"]
    assert np.allclose(normalize_sample([1e-300, 3e-300]), 0.0)  # eps 1e-5 dwarfs the variance


def test_normalize_sample_is_fastln_layer_norm_bit_for_bit_in_ordinary_ranges():
    import fastln

    rng = np.random.default_rng(0)
    for size in (2, 3, 17, 100):
        x = rng.standard_normal(size) * 50 + 3
        gamma, beta = rng.standard_normal(size), rng.standard_normal(size)
        np.testing.assert_array_equal(normalize_sample(x, gamma, beta, 1e-3),
                                      fastln.layer_norm(x, gamma, beta, 1e-3))


# ---------------------------------------------------------------------------------------------
# Bad lines: reported with their number, skipped, exit status 1
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("line, message", [
    ("NROM", "unknown command 'NROM' (expected one of INPUT, NORM, GAMMA, BETA, EPS)"),
    ("10 20 60", "unknown command '10' (expected one of INPUT, NORM, GAMMA, BETA, EPS)"),
    ("INPUT", "INPUT needs at least one value"),
    ("GAMMA", "GAMMA needs at least one value"),
    ("BETA", "BETA needs at least one value"),
    ("EPS", "EPS takes exactly one value, got 0"),
    ("EPS 1 2", "EPS takes exactly one value, got 2"),
    ("EPS -0.5", "EPS must be >= 0, got -0.5"),
    ("EPS nan", "'nan' is not a finite number"),
    ("NORM 3", "NORM takes no values, got 1"),
    ("INPUT 1 two 3", "'two' is not a number"),
    ("INPUT 10, 20", "'10,' is not a number"),
    ("INPUT 1 nan", "'nan' is not a finite number"),
    ("INPUT inf 1", "'inf' is not a finite number"),
    ("INPUT -Infinity", "'-Infinity' is not a finite number"),
    ("INPUT 1e999 1", "'1e999' is not a finite number"),
    ("GAMMA 1 x", "'x' is not a number"),
    ("BETA 1 nan", "'nan' is not a finite number"),
])
def test_each_malformed_line_is_reported_and_skipped(line, message):
    text = f"INPUT 1 2 3\n{line}\nINPUT 10 20 60\nNORM\n"
    status, out, err = run(text)
    assert status == 1
    assert err == [f"line 2: {message}"]
    assert out == ["-1.2247 0.0000 1.2247", "-0.9258 -0.4629 1.3887"]  # processing went on


def test_a_bad_line_changes_nothing():
    status, out, err = run("EPS 100\nEPS -1\nGAMMA 2 2 2\nGAMMA 1 oops 1\nINPUT 10 20 60\nNORM\n")
    assert status == 1 and len(err) == 2
    x_hat = (np.array([10.0, 20.0, 60.0]) - 30.0) / np.sqrt(1400 / 3 + 100)
    assert out == [format_values(2 * x_hat)]  # EPS 100 and GAMMA 2 2 2 still in effect


def test_a_sample_whose_length_differs_from_gamma_or_beta_is_bad():
    status, out, err = run("GAMMA 1 1 1\nINPUT 1 2\nINPUT 1 2 4\nNORM\n"
                           "BETA 0 0 0 0\nINPUT 1 2 3\nNORM\n")
    assert status == 1
    assert err == ["line 2: the sample has 2 value(s), but GAMMA (set on line 1) has 3",
                   "line 6: the sample has 3 value(s), but BETA (set on line 5) has 4"]
    assert out == ["-1.0690 -0.2673 1.3363"]


def test_gamma_set_after_a_sample_is_checked_at_norm():
    status, out, err = run("INPUT 1 2\nINPUT 1 2 3\nGAMMA 1 1 1\nNORM\n")
    assert status == 1
    assert err == ["line 1: the sample has 2 value(s), but GAMMA (set on line 3) has 3; "
                   "skipped by NORM on line 4"]
    assert out == ["-1.2247 0.0000 1.2247"]


def test_a_sample_whose_result_overflows_is_reported_not_printed_as_inf():
    status, out, err = run("GAMMA 1e308 1e308\nBETA 1e308 1e308\nINPUT 1 2\nNORM\n")
    assert (status, out) == (1, [])
    assert err == ["line 3: the normalized sample overflows float64 (GAMMA or BETA too large); "
                   "skipped by NORM on line 4"]


def test_stdout_and_stderr_and_the_exit_status_of_a_mixed_run():
    text = "INPUT 10 20 60\nNORM\nbogus\nINPUT 1 2 3\nNORM\n"
    status, out, err = run(text)
    assert (status, out, err) == (1, ["-0.9258 -0.4629 1.3887", "-1.2247 0.0000 1.2247"],
                                  ["line 3: unknown command 'bogus' (expected one of INPUT, "
                                   "NORM, GAMMA, BETA, EPS)"])


def test_samples_never_normalized_are_mentioned_but_not_an_error():
    status, out, err = run("INPUT 1 2\nNORM\nINPUT 3 4\nINPUT 5 6\n")
    assert (status, out) == (0, ["-1.0000 1.0000"])
    assert err == ["fastln lines: warning: 2 sample(s) (line(s) 3, 4) were never normalized: "
                   "no NORM after them"]


# ---------------------------------------------------------------------------------------------
# The command: stdin, files, options
# ---------------------------------------------------------------------------------------------

def test_reads_a_file(tmp_path):
    path = tmp_path / "commands.txt"
    path.write_text("\ufeff# saved by an editor that writes a BOM\nINPUT 10 20 60\nNORM\nNOPE\n",
                    encoding="utf-8")
    status, stdout, stderr = run_main(["lines", str(path), "--precision", "2"])
    assert (status, stdout) == (1, "-0.93 -0.46 1.39\n")
    assert stderr == "line 4: unknown command 'NOPE' (expected one of INPUT, NORM, GAMMA, BETA, " \
                     "EPS)\n"


@pytest.mark.parametrize("argv", [["lines"], ["lines", "-"]])
def test_reads_stdin(argv, monkeypatch):
    assert run_main(argv, "INPUT 10 20 60\nNORM\n", monkeypatch) == (
        0, "-0.9258 -0.4629 1.3887\n", "")


def test_a_missing_file_is_exit_status_2(tmp_path):
    status, stdout, stderr = run_main(["lines", str(tmp_path / "nope.txt")])
    assert (status, stdout) == (2, "")
    assert stderr.startswith("fastln lines: cannot read ") and "No such file" in stderr


@pytest.mark.parametrize("value", ["-1", "x", "101"])
def test_a_bad_precision_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["lines", "--precision", value])
    assert exit_info.value.code == 2
    assert "--precision" in capsys.readouterr().err


def test_the_installed_command_reads_stdin_and_sets_the_exit_status():
    """The real `python -m fastln lines` with a pipe: the worked example and a bad line."""
    result = subprocess.run([sys.executable, "-m", "fastln", "lines"],
                            input="INPUT 10 20 60\nNORM\nINPUT 1 x\n", capture_output=True,
                            text=True, timeout=60)
    assert result.stdout == "-0.9258 -0.4629 1.3887\n"
    assert result.stderr == "line 3: 'x' is not a number\n"
    assert result.returncode == 1


@pytest.mark.parametrize("ending", ["\n", "\r\n", "\r"], ids=["LF", "CRLF", "CR"])
def test_stdin_and_a_file_read_every_line_ending_alike(ending, tmp_path):
    """A pipe and a file named on the command line split the same bytes into the same lines
    (universal newlines: old Mac text ends its lines with a lone CR)."""
    text = ending.join(["INPUT 10 20 60", "NORM", ""]).encode()
    path = tmp_path / "commands.txt"
    path.write_bytes(text)
    piped = subprocess.run([sys.executable, "-m", "fastln", "lines"], input=text,
                           capture_output=True, timeout=60)
    named = subprocess.run([sys.executable, "-m", "fastln", "lines", str(path)],
                           capture_output=True, timeout=60)
    for result in (piped, named):
        assert (result.returncode, result.stdout, result.stderr) == (
            0, b"-0.9258 -0.4629 1.3887\n", b"")


# ---------------------------------------------------------------------------------------------
# Samples of every magnitude
# ---------------------------------------------------------------------------------------------

def exact_layer_norm(values, eps):
    """x_hat of one sample in exact arithmetic (square root to 200 bits), rounded once to
    float64; a constant sample gives zeros."""
    import math
    from fractions import Fraction
    x = [Fraction(float(v)) for v in values]
    mean = sum(x, Fraction(0)) / len(x)
    var = sum(((v - mean) ** 2 for v in x), Fraction(0)) / len(x) + Fraction(eps)
    if var == 0:
        return [0.0] * len(x)
    shift = 400 - (var.numerator.bit_length() - var.denominator.bit_length())
    shift += shift % 2
    scaled = Fraction(var * Fraction(2) ** shift)
    root = Fraction(math.isqrt(scaled.numerator // scaled.denominator)) / Fraction(2) ** (shift // 2)
    return [float((v - mean) / root) for v in x]


@pytest.mark.parametrize("eps", [0.0, 1e-5, 1e300])
@pytest.mark.parametrize("exponent", [-1074, -1070, -1060, -1040, -1023, -1000, -600, 0, 600,
                                      1000, 1020])
def test_a_sample_of_any_magnitude_normalizes(exponent, eps):
    """The largest |value| below ~5.6e-309 made math.ldexp raise OverflowError (a traceback
    from `fastln lines`); now every magnitude, subnormal to near DBL_MAX, is normalized as
    exact arithmetic says (the subnormal samples as the floats they are)."""
    rng = np.random.default_rng(exponent + 2000)
    sample = np.ldexp(rng.standard_normal(5), exponent)
    sample[0] = -sample[1] if sample[1] != 0 else np.ldexp(1.0, exponent)  # never constant
    got = normalize_sample(sample, eps=eps)
    np.testing.assert_allclose(got, exact_layer_norm(sample, eps), rtol=1e-13, atol=1e-300)
    words = " ".join(repr(float(v)) for v in sample)
    status, out, err = run(f"EPS {eps!r}\nINPUT {words}\nNORM\n")
    assert (status, err) == (0, []) and out == [format_values(exact_layer_norm(sample, eps))]


def test_the_reported_subnormal_sample():
    assert run("INPUT 1e-310 2e-310\nNORM\n") == (0, ["0.0000 0.0000"], [])
    assert run("EPS 0\nINPUT 1e-310 2e-310\nINPUT 5e-324 1e-323\nNORM\n") == (
        0, ["-1.0000 1.0000"] * 2, [])


# ---------------------------------------------------------------------------------------------
# Hostile input and output
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("word", ["١٢", "1_0", "１２", "1٫5", "²", "1e1_0", "0x10", "1,5",
                                  "٣.٥e2", "1 2".replace(" ", "\u00a0"), "1\u20032",
                                  "1\x1c2", "+-1", "1e", "e5", ".", "-", "1.2.3"])
def test_only_plain_ascii_decimal_numbers_are_numbers(word):
    """float() takes other scripts' digits and underscores ('١٢' is 12, '1_0' is 10), and
    str.split other scripts' blanks: neither is the plain notation of the input."""
    status, out, err = run(f"INPUT 1 {word}\nNORM\n")
    assert status == 1 and out == []
    assert err == [f"line 1: {word!r} is not a number"]


@pytest.mark.parametrize("word, value", [("+2.5E+10", 2.5e10), (".5", 0.5), ("5.", 5.0),
                                         ("-0", 0.0), ("007", 7.0), ("1e-400", 0.0),
                                         ("-1.25e-3", -1.25e-3)])
def test_every_form_of_the_plain_notation_is_a_number(word, value):
    from fastln.lines import parse_values
    assert parse_values([word]) == [value]


@pytest.mark.parametrize("word", ["inf", "-INF", "+Infinity", "nan", "NaN", "-nan", "1e999"])
def test_non_finite_words_say_so(word):
    assert run(f"INPUT {word}\n")[2] == [f"line 1: {word!r} is not a finite number"]


def test_commands_are_ascii_words():
    """'ınput'.upper() (a dotless i) is 'INPUT', and 'ſ' (a long s) upper-cases to 'S'."""
    status, out, err = run("ınput 1 2\nEPſ 1\nINPUT 1 2\nNORM\n")
    assert status == 1 and out == ["-1.0000 1.0000"]
    assert err == [f"line 1: unknown command {'ınput'!r} (expected one of INPUT, NORM, GAMMA, "
                   "BETA, EPS)", f"line 2: unknown command {'EPſ'!r} (expected one of INPUT, "
                   "NORM, GAMMA, BETA, EPS)"]


def test_a_byte_order_mark_on_stdin_is_not_part_of_the_first_command(monkeypatch):
    assert run_main(["lines"], "\ufeffINPUT 10 20 60\nNORM\n", monkeypatch) == (
        0, "-0.9258 -0.4629 1.3887\n", "")


@pytest.mark.parametrize("line", ["INPUT 1 {huge}x", "{huge}x 1", "GAMMA {huge}x",
                                  "EPS -{huge}", "INPUT \x1b[31m{huge}"])
def test_a_long_bad_word_is_cut_short_in_the_message(line):
    huge = "1" * 10_000_000
    status, _, err = run(line.format(huge=huge) + "\n")
    assert status == 1 and len(err) == 1
    assert len(err[0]) < 200 and "(1000000" in err[0], err[0][:300]
    assert "\x1b" not in err[0]  # control characters are escaped, never sent to a terminal


@pytest.mark.parametrize("value", ["١٢", "²", "1_0", "+5", "５", "99999999999999999999"])
def test_precision_is_plain_ascii_digits(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["lines", "--precision", value])
    assert exit_info.value.code == 2
    assert "--precision" in capsys.readouterr().err


MANY_LINES = "INPUT 1 2 3\nNORM\n" * 200_000


def test_a_reader_that_stops_reading_ends_the_program_quietly(tmp_path):
    """`fastln lines | head -1`: a BrokenPipeError traceback before; now status 141 (as if
    ended by SIGPIPE) and nothing on stderr."""
    commands = tmp_path / "commands.txt"
    commands.write_text(MANY_LINES)
    with open(commands) as stdin:
        child = subprocess.Popen([sys.executable, "-m", "fastln", "lines"], stdin=stdin,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert child.stdout.readline() == b"-1.2247 0.0000 1.2247\n"
    child.stdout.close()  # as head does after its line
    assert child.wait(timeout=120) == 141
    assert child.stderr.read() == b""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_output_that_cannot_be_written_is_a_message_and_status_2():
    with open("/dev/full", "w") as full:
        child = subprocess.run([sys.executable, "-m", "fastln", "lines"], input=MANY_LINES,
                               stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert child.returncode == 2
    assert child.stderr == "fastln lines: cannot write the output: No space left on device\n"


class _FailingInput:
    """stdin whose reading fails after some lines (EIO), or is interrupted (Ctrl-C)."""

    def __init__(self, error):
        self.error = error

    def __iter__(self):
        yield "INPUT 10 20 60\n"
        yield "NORM\n"
        raise self.error


@pytest.mark.parametrize("error, status, message", [
    (OSError(5, "Input/output error"), 2, "fastln lines: cannot read stdin: Input/output error\n"),
    (IsADirectoryError(21, "Is a directory"), 2, "fastln lines: cannot read stdin: Is a "
                                                 "directory\n"),
    (KeyboardInterrupt(), 130, ""),
])
def test_input_that_cannot_be_read_and_ctrl_c(error, status, message, monkeypatch):
    monkeypatch.setattr(sys, "stdin", _FailingInput(error))
    assert run_main(["lines"]) == (status, "-0.9258 -0.4629 1.3887\n", message)
