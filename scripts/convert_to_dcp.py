"""Write a nanoexp checkpoint of any layout as a torch.distributed.checkpoint (DCP) folder: the whole training state
(weights, optimizer state, step and data position) as one process's full tensors under Hugging Face parameter names.

    python scripts/convert_to_dcp.py outputs/.../checkpoints/100 dcp_out/
    # then, e.g.: torch.distributed.checkpoint.format_utils.dcp_to_torch_save("dcp_out", "state.pt")

Keys: model.<name>, optimizer.state.<name>.<kind> (AdamW: exp_avg, exp_avg_sq, step), train_state.step,
.consumed_samples, .consumed_tokens, .skipped_steps; nanoexp.json beside them holds the config.
scripts/convert_from_dcp.py reads it back. The conversion is nanoexp/interop/dcp.py's (docs/checkpoints.md).
"""
import argparse

from nanoexp.interop.dcp import convert_to_dcp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint folder <checkpoints_path>/<step>")
    parser.add_argument("out", help="the DCP folder to write (new or empty)")
    args = parser.parse_args()
    convert_to_dcp(args.checkpoint, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
