"""Read a torch.distributed.checkpoint (DCP) folder written by scripts/convert_to_dcp.py (possibly changed by other
tools since, keeping its keys and nanoexp.json) into a nanoexp checkpoint at its step, which resumes on any layout.

    python scripts/convert_from_dcp.py dcp_out/ ckpt_out/
    python train.py checkpoint.resume_checkpoint_path=ckpt_out/<step> parallelism=dp2tp2pp2 ...   # any layout

Safety: reading a DCP folder unpickles its .metadata file (torch's FileSystemReader stores DCP's index with pickle,
and unpickling can run code). Convert only folders you trust. nanoexp reads a DCP folder only here, the folder
named on this command line, never one from a run folder by itself. The conversion is nanoexp/interop/dcp.py's.
"""
import argparse

from nanoexp.interop.dcp import convert_from_dcp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dcp_folder", help="a DCP folder from scripts/convert_to_dcp.py (its .metadata is unpickled)")
    parser.add_argument("out", help="checkpoints folder (new or empty): the checkpoint is written to OUT/<step>")
    args = parser.parse_args()
    path = convert_from_dcp(args.dcp_folder, args.out)
    print(f"wrote {path}; train from it with:\n  python train.py checkpoint.resume_checkpoint_path={path} ...")


if __name__ == "__main__":
    main()
