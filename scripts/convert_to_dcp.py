"""Write a nanoexp checkpoint of any layout as a torch.distributed.checkpoint (DCP) folder: the whole training state
(weights, optimizer state, step and data position) as one process's full tensors under Hugging Face parameter names.

    python scripts/convert_to_dcp.py outputs/.../checkpoints/100 dcp_out/
    # then, e.g.: torch.distributed.checkpoint.format_utils.dcp_to_torch_save("dcp_out", "state.pt")

Keys: model.<name>, optimizer.state.<name>.<kind> (AdamW: exp_avg, exp_avg_sq, step), train_state.step,
.consumed_samples, .consumed_tokens, .skipped_steps; nanoexp.json beside them holds the config.
scripts/convert_from_dcp.py reads it back. The conversion is nanoexp/interop/dcp.py's (docs/checkpoints.md).
A checkpoint that is not one, or has a missing or truncated shard, and an OUT that is not new or empty are refused
in one line naming the file (exit 2); nothing is written then.
"""
import argparse
import sys

from nanoexp.failures import run_tool
from nanoexp.interop.dcp import convert_to_dcp


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint folder <checkpoints_path>/<step>")
    parser.add_argument("out", help="the DCP folder to write (new or empty)")
    args = parser.parse_args()
    code = run_tool("convert_to_dcp.py", lambda: convert_to_dcp(args.checkpoint, args.out))
    if code == 0:
        print(f"wrote {args.out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
