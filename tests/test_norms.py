"""RMSNorm with a residual in three kernels (norms.py): stock's bits, which calls it takes, the switch,
the startup line and the restore.

The kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before they are defined, so in a
subprocess of its own) on CPU tensors, where torch's mean is the CPU one for stock and plugin alike;
norms.counting_fused says which calls fused. fp16 only: the interpreter casts fp32 to bf16 by
truncation, where a GPU rounds to nearest even. On a GPU, bf16 and fp16 with SGLang's batch-invariant
mean are tests/gpu/test_norm_bits.py's.
"""

import pytest
from conftest import run_interpreted

from sglang_chunk_align.compat import NORMS_ENV

ARMED = r"""
import logging, os
from sglang.srt.layers.layernorm import RMSNorm
from sglang_chunk_align import norms, patch_table, patches
kernels._batch_invariant_MODE = True  # SGLang's flag; its enable call refuses a machine without an accelerator
torch.manual_seed(0)
report = {}
"""

BITS = ARMED + r"""
for columns in (640, 1000):  # under and over one kernel block, neither a multiple of it
    norm = RMSNorm(columns, eps=1e-6).half()
    torch.nn.init.normal_(norm.weight, mean=1.0, std=0.1)
    x, residual = torch.randn(4, 128, columns).half(), (4 * torch.randn(4, 128, columns)).half()
    stock = norm.forward_native(x, residual)
    fused, after_remove = [], []
    patches.apply(patch_table)
    with norms.counting_fused(fused):
        plugin = norm.forward_native(x, residual)
    patches.remove()
    with norms.counting_fused(after_remove):
        restored = norm.forward_native(x, residual)
    # The control: stock's arithmetic with each row's sum of squares in reverse order.
    reversed_norm = RMSNorm(columns, eps=1e-6).half()
    reversed_norm.weight.data = norm.weight.data.flip(0)
    flipped = reversed_norm.forward_native(x.flip(-1), residual.flip(-1))[0].flip(-1)
    report[columns] = {
        "fused": [list(shape) for shape in fused],
        "out_equal": torch.equal(plugin[0], stock[0]), "residual_equal": torch.equal(plugin[1], stock[1]),
        "control_rows_differ": int((flipped != stock[0]).any(-1).sum()),
        "after_remove_stock": torch.equal(restored[0], stock[0]) and after_remove == [],
    }
json.dump(report, sys.stdout)
"""

DISPATCH = ARMED + r"""
def norm(**options):
    return RMSNorm(64, **options).half()

x, residual = torch.randn(3, 64).half(), torch.randn(3, 64).half()
fusable = lambda: norm().forward_native(x, residual)
calls = {
    "a residual of x's dtype and shape": fusable,
    "no residual": lambda: norm().forward_native(x),
    "a post-residual addition": lambda: norm().forward_native(x, residual, residual),
    "an fp32 residual": lambda: norm(fp32_residual=True).forward_native(x, residual),
    "a cast before the weight": lambda: norm(cast_x_before_out_mul=True).forward_native(x, residual),
    "a variance size": lambda: norm(var_hidden_size=32).forward_native(x, residual),
    "an fp32 input": lambda: norm().float().forward_native(x.float(), residual.float()),
    "a residual of another dtype": lambda: norm().forward_native(x, residual.float()),
    "no rows": lambda: norm().forward_native(x[:0], residual[:0]),
}
lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("sglang_chunk_align").addHandler(Keep())
logging.getLogger("sglang_chunk_align").setLevel(logging.INFO)

def fused_by(call):
    shapes = []
    with norms.counting_fused(shapes):
        call()
    return len(shapes)

patches.apply(patch_table)
report["fused"] = {why: fused_by(call) for why, call in calls.items()}
kernels._batch_invariant_MODE = False
report["mode_off"] = fused_by(fusable)
kernels._batch_invariant_MODE = True
patches.remove()
os.environ[SWITCH] = "0"
patches.apply(patch_table)
report["switched_off"] = fused_by(fusable) + fused_by(fusable)
patches.remove()  # forgets the switch: the next armed process reads it again
del os.environ[SWITCH]
patches.apply(patch_table)
report["switched_on_again"] = fused_by(fusable)
patches.remove()
report["lines"] = lines
json.dump(report, sys.stdout)
"""


@pytest.fixture(scope="module")
def bits():
    return run_interpreted(BITS)


@pytest.fixture(scope="module")
def dispatch():
    return run_interpreted(f"SWITCH = {NORMS_ENV!r}\n" + DISPATCH)


@pytest.mark.parametrize("columns", ["640", "1000"])
def test_a_norm_with_a_residual_runs_fused_with_stock_bits(bits, columns):
    found = bits[columns]
    assert found["fused"] == [[4, 128, int(columns)]]
    assert found["out_equal"] and found["residual_equal"]
    assert found["control_rows_differ"] > 0, "a reversed sum gave stock's bits: this check could not see a difference"
    assert found["after_remove_stock"]


def test_only_calls_stock_would_compute_alike_are_fused(dispatch):
    fused = dispatch["fused"]
    assert fused.pop("a residual of x's dtype and shape") == 1
    assert fused == dict.fromkeys(fused, 0), "these keep stock's forward_native"
    assert dispatch["mode_off"] == 0, "batch-invariant mode off: torch's mean is not SGLang's"


def test_the_switch_keeps_stock_and_the_line_says_which(dispatch):
    assert dispatch["switched_off"] == 0 and dispatch["switched_on_again"] == 1
    off = f"RMSNorms that add a residual keep stock's eleven kernels ({NORMS_ENV}=0)"
    on = f"run as three kernels in stock's arithmetic, for stock's bits ({NORMS_ENV}=0 keeps stock's eleven)"
    assert [line for line in dispatch["lines"] if off in line or on in line] == [
        f"sglang-chunk-align: RMSNorms that add a residual {on}", f"sglang-chunk-align: {off}",
        f"sglang-chunk-align: RMSNorms that add a residual {on}"]
