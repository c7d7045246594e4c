"""argparse types the commands share (plan, verify, probe).

Standard library only: `python -m sglang_chunk_align.tools.probe` runs on a GPU
machine where only torch and flashinfer are installed.
"""

import argparse


def at_least(lowest, highest=None):
    """An argparse type: an integer, >= lowest and <= highest where given, so each bad argument is named on its own."""

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or lowest is not None and value < lowest:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer" + (f" >= {lowest}" if lowest is not None else ""))
        if highest is not None and value > highest:
            raise argparse.ArgumentTypeError(f"{text!r} is above {highest}, the longest prompt plan lists")
        return value

    return parse
