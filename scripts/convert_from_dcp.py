"""Read a torch.distributed.checkpoint (DCP) folder written by scripts/convert_to_dcp.py (possibly changed by other
tools since, keeping its keys and nanoexp.json) into a nanoexp checkpoint at its step, which resumes on any layout.

    python scripts/convert_from_dcp.py dcp_out/ ckpt_out/
    python train.py checkpoint.resume_checkpoint_path=ckpt_out/<step> parallelism=dp2tp2pp2 ...   # any layout

Safety: DCP stores its index (.metadata) as a pickle. nanoexp reads it with a restricted unpickler that admits only
the classes DCP's index is made of, so a crafted .metadata naming anything else (os.system, ...) is refused in one
line before any of it runs; tensors are read with torch's weights-only loads. nanoexp reads a DCP folder only here,
the folder named on this command line. A folder that is not DCP's or lacks nanoexp.json, and an OUT that is not new
or empty, are refused in one line naming the file (exit 2). The conversion is nanoexp/interop/dcp.py's.
"""
import argparse
import sys

from nanoexp.failures import run_tool
from nanoexp.interop.dcp import convert_from_dcp


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dcp_folder", help="a DCP folder from scripts/convert_to_dcp.py (its .metadata is read by a "
                        "restricted unpickler)")
    parser.add_argument("out", help="checkpoints folder (new or empty): the checkpoint is written to OUT/<step>")
    args = parser.parse_args()
    written = []
    code = run_tool("convert_from_dcp.py", lambda: written.append(convert_from_dcp(args.dcp_folder, args.out)))
    if code == 0:
        print(f"wrote {written[0]}; train from it with:\n"
              f"  python train.py checkpoint.resume_checkpoint_path={written[0]} ...")
    return code


if __name__ == "__main__":
    sys.exit(main())
