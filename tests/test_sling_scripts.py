"""SLING's own Myelin checks, its sling/myelin/tests/gradcheck.py and opcheck.py, run
unchanged on ranvier.

The scripts import `sling.flags`, `sling.myelin` and (opcheck) SLING's numpy simulator.
A package made for the run maps `sling.myelin` to ranvier, `sling.flags` to argparse with
the flags the scripts read, and takes the simulator from SLING's sources, with the one op
ranvier's builder adds that SLING's builder does not: Softmax, computed as SLING's
builder defines it (exp(x - max x) divided by its L2 norm, where ranvier and Myelin's C++
compiler divide by the sum), so opcheck shows that difference and nothing else.

SLING's sources are not part of ranvier: the tests run where SLING_SOURCE names a
checkout of google/sling, and skip otherwise (SLING_SOURCE=~/sling pytest -m slow
tests/test_sling_scripts.py). opcheck.py's full run compiles some 20,000 cells; here it
runs its checks of every op family at a few sizes, through its own --test flag.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLING = Path(os.environ.get("SLING_SOURCE", "/nonexistent")).expanduser()
SCRIPTS = SLING / "sling" / "myelin" / "tests"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (SCRIPTS / "gradcheck.py").is_file(), reason="SLING_SOURCE does not name a google/sling checkout"),
]

FLAGS = '''import argparse

arg = argparse.Namespace()
parser = argparse.ArgumentParser()


def define(*args, **kwargs):
    parser.add_argument(*args, **kwargs)


def parse():
    parser.parse_args(namespace=arg)


# The flags SLING's C++ side defines that the scripts read.
define("--v", type=int, default=0)
define("--cpu", default="")
for name in ("profile", "gpu", "mkl"):
    define("--" + name, action="store_true", default=False)
'''

SOFTMAX = '''    elif op.type == "Softmax":
      e = np.exp(v[i[0]] - np.max(v[i[0]]))
      v[o[0]] = e / np.sqrt(np.sum(np.square(e)))
'''


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shim")
    package = root / "sling"
    (package / "myelin").mkdir(parents=True)
    # gradcheck.py draws its points unseeded, asin's and acos's from [-1, 1], and steps eps
    # beside them: a point within eps of ±1 takes a finite difference outside the domain, NaN,
    # whose deviation the script's log10 cannot take (about one run in three). Seeded, the run
    # is the same each time.
    (package / "__init__.py").write_text("import numpy\n\nnumpy.random.seed(0)\n")
    (package / "flags.py").write_text(FLAGS)
    (package / "myelin" / "__init__.py").write_text("from ranvier import *  # noqa: F403\n")
    simulator = (SLING / "python" / "myelin" / "simulator.py").read_text()
    unsupported = '    else:\n      raise Exception("No NumPy support for " + op.type)'
    assert unsupported in simulator, "SLING's simulator no longer ends its op list as this test expects"
    (package / "myelin" / "simulator.py").write_text(simulator.replace(unsupported, SOFTMAX + unsupported))
    return root


def run_script(shim: Path, script: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim), str(ROOT)]))
    done = subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True, env=env,
                          timeout=1800, check=False)
    assert done.returncode == 0 and not done.stderr.strip(), done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("args", [(), ("--fp64",)], ids=["float32", "float64"])
def test_gradcheck_runs_every_check_without_an_error(shim, args):
    """Every check reports its precision; the element-wise mismatches it may print are its
    own step's error (eps=1e-3 near a pole of tan, sec, rcp...), which the gradient tests
    here measure with float64 steps instead (test_myelin.py, test_vjp.py)."""
    out = run_script(shim, "gradcheck.py", *args)
    checked = re.findall(r"^(\w+) : (None|\d+) ulp$", out, re.MULTILINE)
    expected = 51 if not args else 48  # max, min and softmax are float32-only checks
    assert len(checked) == expected, out


def test_opcheck_passes_every_op_family_but_softmax(shim):
    families = [
        "add", "sub", "mul", "div", "minimum", "maximum", "argmax", "argmin", "neg", "abs", "square", "relu", "bcast",
        "shape", "size", "rank", "rcp", "sqrt", "rsqrt", "exp", "log", "sin", "cos", "tan", "asin", "acos", "atan",
        "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "trig", "erf", "sigmoid", "softmax", "sum", "product", "min",
        "max", "all", "any", "count", "norm", "sign", "floor", "ceil", "round", "trunc", "equal", "not_equal", "less",
        "less_equal", "greater", "greater_equal", "logic", "cond", "select",
    ]
    program = "\n".join([
        "for i in [1, 7, 16, 33]:",
        *[f"  {name}_test(i)" for name in families],
        "  bcast_repeat_test(i, 256, 1)",
        "  pow_test(i, 2.5); pow_test(i, -1.0)",
        "  add_const_test(i, -1); mul_const_test(i, 3)",
        "  for f in [1, 5]:",
        "    gather_test(32, i, f); gather_sum_test(32, i, f); gather_max_test(32, i, f)",
        "    gather_avg_test(32, i, f); scatter_add_test(32, i, f)",
        "  concat_test(i, 5); split_test(i, 1)",
        "  for j in [1, 9]:",
        "    matmul_transpose_test(i, j); matmul_all_orders_test(i, j, 32)",
        "    matmul_test(i, j, 5); matmul_add_test(i, j, 5); matmul_add_relu_test(i, j, 5)",
        "    matmul_batch_test(i, j, 5, 8); acc_matmul_test(i, j, 5)",
        "    transpose_test(i, j, 5, [1, 2, 0]); sum_axis_test(i, j, 5, 1); max_axis_test(i, j, 5, 2)",
        "negfold_test(8); acc_matmul_transpose_test()",
        "print('mismatched', sorted({name for name, test in tests.items() if test.failed()}))",
        "print('outputs', sum(test.runs for test in tests.values()))",
    ])
    out = run_script(shim, "opcheck.py", "--skipdiff", "--test", program)
    assert "mismatched ['softmax']" in out, out[-3000:]
    assert set(re.findall(r"ERROR: mismatch in (\w+)", out)) == {"softmax"}
