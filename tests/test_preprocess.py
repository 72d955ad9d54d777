"""scripts/preprocess_data.py: text files -> Nanoset, equal to the tokenizer's own output."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from nanoexp.data import HFTokenizer, NanosetWriter, open_nanoset
from nanoexp.data.nanoset import token_dtype
from nanoexp.data.preprocess import preprocess
from tests.data_files import byte_stream, random_documents, write_jsonl
from tests.helpers import require
from tests.test_data import _save_tiny_hf_tokenizer

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "preprocess_data.py")


def preprocess_data(*args: str) -> subprocess.CompletedProcess:
    """The script as a user runs it."""
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_cli_round_trip_refuses_then_overwrites(tmp_path):
    docs = random_documents(40)
    src = write_jsonl(tmp_path / "a.jsonl", docs[:25], key="content")
    write_jsonl(tmp_path / "b.jsonl", docs[25:], key="content")
    out = tmp_path / "nanoset"
    common = ["--text-key", "content", "--output-folder", str(out), "--no-progress"]
    result = preprocess_data("--input", str(tmp_path / "*.jsonl"), *common)
    assert result.returncode == 0 and "40 documents" in result.stdout, result.stderr
    tokens, ends, meta = open_nanoset(out)
    assert tokens.tolist() == byte_stream(docs)        # glob order a, b; eod after each document
    assert tokens.dtype == np.uint16 and meta["dtype"] == "uint16"
    assert ends.tolist() == np.cumsum([len(d.encode()) + 1 for d in docs]).tolist()
    assert (meta["tokenizer"], meta["vocab_size"], meta["eod_id"]) == ("byte", 257, 256)
    assert (meta["num_documents"], meta["num_tokens"], meta["format_version"]) == (40, len(tokens), 1)
    # A second run refuses and leaves the Nanoset untouched; --overwrite replaces it.
    result = preprocess_data("--input", src, *common)
    assert result.returncode == 2 and "--overwrite" in result.stderr
    assert open_nanoset(out)[2]["num_documents"] == 40
    assert preprocess_data("--input", src, *common, "--overwrite").returncode == 0
    assert open_nanoset(out)[2]["num_documents"] == 25


def test_an_empty_input_is_refused_and_leaves_no_folder(tmp_path):
    """Refused with an error the script reports as one line (exit code 2), before anything is written."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    (tmp_path / "nothing").mkdir()
    for source, said in [("empty.txt", "no data: the file is empty (0 bytes)"),
                         ("blank.jsonl", "no text to tokenize (2 documents, all empty)"),
                         ("nothing", "expected data files of one kind")]:
        out = tmp_path / f"nanoset-{source}"
        with pytest.raises((FileExistsError, FileNotFoundError, KeyError, ValueError)) as refused:
            preprocess([str(tmp_path / source)], str(out), progress=False)
        assert said in str(refused.value)
        assert not out.exists()


def test_hf_tokenizer_parquet_and_txt_match_tokenizer_and_workers(tmp_path):
    pa = require("pyarrow")
    import pyarrow.parquet as pq

    _save_tiny_hf_tokenizer(tmp_path / "tok", eos=True)
    tok = HFTokenizer(tmp_path / "tok")
    docs = random_documents(600, seed=1)
    pq.write_table(pa.table({"text": docs}), tmp_path / "docs.parquet")
    reference = []
    for d in docs:
        reference += tok.encode(d) + [tok.eod_id]
    one = preprocess([str(tmp_path / "docs.parquet")], str(tmp_path / "w1"), str(tmp_path / "tok"), progress=False)
    two = preprocess([str(tmp_path / "docs.parquet")], str(tmp_path / "w2"), str(tmp_path / "tok"), workers=2,
                     progress=False)
    assert one["num_tokens"] == two["num_tokens"] == len(reference) and one["tokens_per_sec"] > 0
    assert open_nanoset(tmp_path / "w1")[0].tolist() == reference
    assert (tmp_path / "w1" / "tokens.bin").read_bytes() == (tmp_path / "w2" / "tokens.bin").read_bytes()
    # Plain text: one document per file.
    (tmp_path / "txt").mkdir()
    for i, d in enumerate(docs[:3]):
        (tmp_path / "txt" / f"{i}.txt").write_text(d, encoding="utf-8")
    preprocess([str(tmp_path / "txt")], str(tmp_path / "t"), "byte", progress=False)
    tokens, _, meta = open_nanoset(tmp_path / "t")
    assert meta["num_documents"] == 3 and tokens.tolist() == byte_stream(docs[:3])


def test_dtype_follows_vocabulary(tmp_path):
    assert token_dtype(257) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    big = [np.array([0, 65535, 70000, 5], dtype=np.int64), np.array([69999])]
    with NanosetWriter(tmp_path, "big-tokenizer", 70001, 70000) as w:
        w.add(big)
    tokens, ends, meta = open_nanoset(tmp_path)
    assert meta["dtype"] == "uint32" and tokens.tolist() == [0, 65535, 70000, 5, 70000, 69999, 70000]
    assert ends.tolist() == [5, 7]
    assert json.loads((tmp_path / "metadata.json").read_text())["num_tokens"] == 7
