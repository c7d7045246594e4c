"""argparse types and error reporting the commands share (plan, verify, probe, doctor).

Standard library only: `python -m sglang_chunk_align.tools.probe` runs on a GPU
machine where only torch and flashinfer are installed.
"""

import argparse
import json


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


def report_errors_as_json(*parsers):
    """With --json, a bad argument (argparse's exit 2) is also a JSON report on stdout, as a
    failure to run is, so a script reading the report reads every outcome."""
    for parser in parsers:

        def error(message, usage_error=parser.error):
            print(json.dumps({"ok": False, "error": message}))
            usage_error(message)

        parser.error = error
