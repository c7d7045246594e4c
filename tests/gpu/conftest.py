# Let `pytest tests/gpu` import sglang_chunk_align from this checkout without installing it.
import pathlib
import sys

_ROOT = str(pathlib.Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
