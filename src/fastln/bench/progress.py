"""Progress on stderr: a tqdm bar on a terminal when tqdm is installed, otherwise a plain
counter (one line per step in a log file, where a bar would be a heap of carriage returns)."""
import sys


class _PlainProgress:
    """The fallback: one rewritten line on a terminal, one line per step in a log file."""

    def __init__(self, total, stream):
        self.total = total
        self.done = 0
        self.stream = stream
        self.interactive = hasattr(stream, "isatty") and stream.isatty()
        self.description = ""

    def set_description(self, description):
        self.description = description
        self._show()

    def update(self, steps=1):
        self.done += steps

    def _show(self):
        # The step being worked on, counting from 1.
        line = f"[{min(self.done + 1, self.total)}/{self.total}] {self.description}"
        if self.interactive:
            self.stream.write("\r" + line.ljust(79)[:79])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self):
        if self.interactive:
            self.stream.write("\r" + " " * 79 + "\r")
            self.stream.flush()


class Progress:
    """``with Progress(total) as bar: bar.set_description(...); bar.update()``; silent if off."""

    def __init__(self, total, enabled=True, stream=None, unit="case"):
        self.total = total
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.unit = unit
        self._bar = None

    def __enter__(self):
        if not self.enabled:
            return self
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        if tqdm is None or not (hasattr(self.stream, "isatty") and self.stream.isatty()):
            self._bar = _PlainProgress(self.total, self.stream)
        else:
            self._bar = tqdm(total=self.total, file=self.stream, unit=self.unit, leave=False,
                             dynamic_ncols=True)
        return self

    def set_description(self, description):
        if self._bar is not None:
            self._bar.set_description(description)

    def update(self, steps=1):
        if self._bar is not None:
            self._bar.update(steps)

    def __exit__(self, *exc_info):
        if self._bar is not None:
            self._bar.close()
        return False
