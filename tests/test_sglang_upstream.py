"""SGLang's own CPU unit tests of the code the plugin patches, with the plugin loaded.

They are SGLang's files (Apache-2.0), read at the installed release from a
checkout of SGLang's repository named by SGLANG_UPSTREAM_TESTS, never copied
here. SGLang's wheels do not ship them and CI reaches only package registries,
so CI skips this with its reason; tests/test_stock_where_unarmed.py holds the
same rule in CI (a bare Scheduler, deterministic flashinfer never configured). Each file runs in a
fresh interpreter three ways: stock, after apply(), and after SGLang's
load_plugins() with SGLANG_PLUGINS=chunk_align. It must pass everywhere it
passes on stock: they build Schedulers without a worker and never configure
deterministic flashinfer, where the plugin is not armed.
"""

import json
import os

import pytest

from sglang_chunk_align import releases
from sglang_chunk_align.compat import installed_version

UPSTREAM_ENV = "SGLANG_UPSTREAM_TESTS"
_RUN = """
import json, os, sys, unittest
if sys.argv[1] == "apply":
    import sglang_chunk_align
    sglang_chunk_align.apply()
elif sys.argv[1] == "load_plugins":
    os.environ["SGLANG_PLUGINS"] = "chunk_align"
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang_chunk_align import patches
    assert patches.state() == patches.APPLIED, patches.state()
tests = unittest.defaultTestLoader.discover(os.path.dirname(sys.argv[2]), pattern=os.path.basename(sys.argv[2]))
result = unittest.TextTestRunner(verbosity=2).run(tests)
print(json.dumps({"ran": result.testsRun, "failed": len(result.failures) + len(result.errors)}))
"""

# Listed for the newest release (releases.UPSTREAM_UNIT_TESTS); tests/test_stock_where_unarmed.py
# asks the same of every release.
FILES = releases.UPSTREAM_UNIT_TESTS if str(installed_version()) == releases.NEWEST else ()


@pytest.mark.skipif(not FILES, reason=f"SGLang's unit tests are listed for {releases.NEWEST}, not {installed_version()}")
@pytest.mark.skipif(not os.environ.get(UPSTREAM_ENV), reason=f"set {UPSTREAM_ENV} to a checkout of SGLang's repository at v{releases.NEWEST} (not on PyPI, so CI cannot fetch it)")
@pytest.mark.parametrize("path", FILES)
def test_sglang_unit_tests_pass_with_the_plugin_loaded(fresh_python, path):
    test_file = os.path.join(os.environ[UPSTREAM_ENV], path)
    assert os.path.exists(test_file), f"{test_file} is missing: fetch SGLang's tests at {installed_version()}"
    outcomes = {}
    for mode in ("stock", "apply", "load_plugins"):
        done = fresh_python(f"import sys; sys.argv[1:] = [{mode!r}, {test_file!r}]\n" + _RUN)
        assert done.returncode == 0, (mode, done.stdout[-2000:], done.stderr[-4000:])
        outcomes[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcomes["stock"]["ran"] > 0 and outcomes["stock"]["failed"] == 0, outcomes
    assert outcomes["apply"] == outcomes["load_plugins"] == outcomes["stock"], outcomes
