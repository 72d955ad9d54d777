"""The mixture-of-experts parity table: every layout tests/test_moe.py trains, against one process.

    python benchmarks/moe_parity.py                 # every layout of tests/test_moe.py's LAYOUTS
    python -m benchmarks.moe_parity ep2 ep2cp2      # some of them

Each layout trains moe_tiny on the tests' small shape for 8 steps (float32, gloo), as the test does, beside one
process (its own, for a layout that changes the model: another router or expert kernel); printed per layout: the largest relative difference
over the 8 steps of the language-model loss, the gradient norm, the load-balancing loss and the z-loss, and
whether the expert loads were equal.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a file: the repository root
from tests.helpers import FAST, train  # noqa: E402
from tests.test_moe import LAYOUTS, MOE, STEPS, moe_curves  # noqa: E402


def relative(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.max(np.abs(ours / reference - 1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("layouts", nargs="*", default=list(LAYOUTS), help=f"of {', '.join(LAYOUTS)}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        one = moe_curves(train(f"{root}/one", FAST + MOE + STEPS))
        print(f"{'layout':<40} {'loss':>9} {'grad norm':>9} {'aux':>9} {'z':>9}  loads")
        for name in args.layouts:
            ours = moe_curves(train(f"{root}/{name}", FAST + MOE + STEPS + LAYOUTS[name]))
            model = [o for o in LAYOUTS[name] if o.startswith("model.")]
            reference = moe_curves(train(f"{root}/{name}-one", FAST + MOE + STEPS + model)) if model else one
            loads = all(np.array_equal(ours[k], reference[k]) for k in ours if k.startswith("moe_load"))
            print(f"{name:<40} " + " ".join(f"{relative(ours[k], reference[k]):9.1e}" for k in
                                            ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss"))
                  + f"  {'equal' if loads else 'differ'}", flush=True)


if __name__ == "__main__":
    main()
