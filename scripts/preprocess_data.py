"""Tokenize text into a Nanoset folder (tokens.bin, documents.npy, metadata.json) for data=nanoset.

    python scripts/preprocess_data.py --input data/*.jsonl --text-key text --tokenizer byte \
        --output-folder data/nanoset/web --workers 8

Inputs: local json/jsonl, parquet, csv or txt files (one document per .txt file), folders of them,
or one Hugging Face Hub dataset name (needs the network). ``--tokenizer``: ``byte``, a local
Hugging Face tokenizer folder, or a Hub tokenizer name. An existing Nanoset is replaced only with
``--overwrite``.
"""

from __future__ import annotations

import argparse
import sys

from nanoexp.data.preprocess import preprocess


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, help="files, folders, globs, or a Hub dataset name")
    parser.add_argument("--output-folder", required=True)
    parser.add_argument("--tokenizer", default="byte", help="byte, a local tokenizer folder, or a Hub name")
    parser.add_argument("--text-key", default="text", help="the column holding the text")
    parser.add_argument("--split", default="train", help="split of a Hub dataset or saved DatasetDict")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing Nanoset in the folder")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        meta = preprocess(args.input, args.output_folder, args.tokenizer, args.text_key, args.workers,
                          args.overwrite, args.split, progress=not args.no_progress)
    except (FileExistsError, FileNotFoundError, KeyError, ValueError) as error:
        print(f"preprocess_data: {error}", file=sys.stderr)
        return 2
    print(f"{meta['num_documents']} documents, {meta['num_tokens']} tokens ({meta['dtype']}) in "
          f"{meta['seconds']:.1f} s: {meta['tokens_per_sec']:,.0f} tokens/s -> {args.output_folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
