"""data=hf: local files, save_to_disk folders, streaming; packing, the held-out rule, resume, errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoexp.data import ByteTokenizer, TokenWindows, TrainBatches, build_hf_datasets
from tests.data_files import byte_stream, random_documents, write_jsonl
from tests.helpers import FAST, compose_config, require, start_error, train, train_py
from tests.test_data import _save_tiny_hf_tokenizer

SEQ = 8


@pytest.fixture
def jsonl_folder(tmp_path):
    docs = random_documents(90, seed=3)
    (tmp_path / "docs").mkdir()
    write_jsonl(tmp_path / "docs" / "part-0.jsonl", docs[:50])
    write_jsonl(tmp_path / "docs" / "part-1.jsonl", docs[50:])
    return str(tmp_path / "docs"), docs


def build(path, streaming, val_samples=None):
    return build_hf_datasets(path, "train", None, "text", streaming, ByteTokenizer(), SEQ, 0.1, val_samples)


def test_stream_and_table_give_the_reference_samples(jsonl_folder):
    path, docs = jsonl_folder
    train_ref = np.array(byte_stream([d for i, d in enumerate(docs) if i % 10 != 9]))
    val_ref = TokenWindows(np.array(byte_stream(docs[9::10])), SEQ)   # every 10th document is held out
    table_train, table_val = build(path, streaming=False)
    stream_train, stream_val = build(path, streaming=True)
    reference = TokenWindows(train_ref, SEQ)
    assert len(table_train) == len(reference) and len(table_val) == len(val_ref) == len(stream_val)
    for i in range(len(reference)):
        assert torch.equal(table_train[i], reference[i]) and torch.equal(stream_train[i], reference[i])
    assert all(torch.equal(stream_val[i], val_ref[i]) for i in range(len(val_ref)))
    # The stream goes on into the next epoch, and reading backwards restarts it.
    two_epochs = TokenWindows(np.concatenate([train_ref, train_ref]), SEQ)
    k = len(reference) + 3
    assert torch.equal(stream_train[k], two_epochs[k]) and torch.equal(stream_train[2], reference[2])
    # Streaming reads only as much validation as evaluation uses.
    assert len(build(path, streaming=True, val_samples=2)[1]) < len(val_ref)


def test_save_to_disk_folder_matches_jsonl(jsonl_folder, tmp_path):
    datasets = require("datasets")
    path, docs = jsonl_folder
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "saved"))
    for streaming in (False, True):
        saved, _ = build(str(tmp_path / "saved"), streaming)
        ref, _ = build(path, streaming=False)
        assert all(torch.equal(saved[i], ref[i]) for i in range(20))


def test_stream_batches_are_dp_split_invariant_and_resume(jsonl_folder):
    path, _ = jsonl_folder
    G, steps = 8, 5
    runs = {}
    for dp, mbs in [(1, 4), (2, 2)]:
        per_rank = []
        for rank in range(dp):
            with TrainBatches(build(path, True)[0], G, mbs, rank, dp, seed=0, prefetch=True) as loader:
                per_rank.append([torch.cat([mb["input_ids"] for mb in loader.next_step()]) for _ in range(steps)])
        runs[dp] = [torch.cat([per_rank[r][s] for r in range(dp)]) for s in range(steps)]
    assert all(torch.equal(a, b) for a, b in zip(runs[1], runs[2]))
    with TrainBatches(build(path, True)[0], G, 4, 0, 1, seed=0, consumed_samples=3 * G) as resumed:
        assert torch.equal(torch.cat([mb["input_ids"] for mb in resumed.next_step()]), runs[1][3])


def text_file(path, paragraphs: int, seed: int = 5) -> str:
    """A plain .txt file: paragraphs of lines, separated by blank lines (one document, as a file is)."""
    docs = random_documents(paragraphs, seed=seed)
    path.write_text("\n\n".join("\n".join(doc[i:i + 60] for i in range(0, len(doc), 60)) for doc in docs) + "\n")
    return str(path)


def test_a_single_text_file_holds_out_its_tail(tmp_path):
    """One .txt is one document: the every-10th-document rule would hold out nothing (its evaluation failed with
    '0 tokens are too few'); the last 10 % of its text, from a line start, is held out instead, streamed or not."""
    from nanoexp.data.corpus import split_train_val
    text = open(text_file(tmp_path / "book.txt", 60)).read()
    head, tail = split_train_val([text], 0.1)
    assert head[0] + tail[0] == text and head[0].endswith("\n") and 0 < len(tail[0]) <= 0.1 * len(text)
    for streaming in (False, True):
        train_set, val = build(str(tmp_path / "book.txt"), streaming)
        reference, held_out = TokenWindows(np.array(byte_stream(head)), SEQ), TokenWindows(np.array(byte_stream(tail)), SEQ)
        assert len(train_set) == len(reference) and len(val) == len(held_out) > 0
        assert all(torch.equal(train_set[i], reference[i]) for i in range(len(reference)))
        assert all(torch.equal(val[i], held_out[i]) for i in range(len(held_out)))


def test_a_text_file_too_short_is_refused_before_its_run_folder(tmp_path, capsys):
    """A text too short for a global batch or for one held-out sample: one line saying what to do, exit 2, and
    no run folder left behind (the run once failed in its workers with a traceback, leaving one)."""
    short = text_file(tmp_path / "short.txt", 3)
    assert train_py(FAST + ["data=hf", f"data.hf_dataset_or_datasets={short}", "debug=fast"],
                    tmp_path / "run") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"nanoexp: data: data.hf_dataset_or_datasets={short}: 1 document(s)")
    assert err[0].endswith("use more text, a shorter tokens.sequence_length or a smaller tokens.global_batch_size")
    assert not (tmp_path / "run").exists()


def hf_cfg(path, *extra):
    return compose_config(FAST + ["data=hf", f"data.hf_dataset_or_datasets={path}", *extra])


def test_bad_hf_data_is_named(jsonl_folder, tmp_path):
    path, _ = jsonl_folder
    assert "no column 'body'" in start_error(hf_cfg(path, "data.text_column_name=body"))
    assert f"{tmp_path}/nope: no such file or folder" in start_error(hf_cfg(tmp_path / "nope"))
    write_jsonl(tmp_path / "blank.jsonl", ["", ""])
    assert "the dataset is empty" in start_error(hf_cfg(tmp_path / "blank.jsonl"))
    (tmp_path / "zero.jsonl").write_text("")   # datasets' own reader fails on it with a bare StopIteration
    assert f"{tmp_path}/zero.jsonl: no data: the file is empty (0 bytes)" in start_error(hf_cfg(tmp_path / "zero.jsonl"))
    assert "data.hf_dataset_or_datasets is not set" in start_error(compose_config(FAST + ["data=hf"]))


def test_streaming_training_with_a_local_tokenizer(jsonl_folder, tmp_path):
    path, _ = jsonl_folder
    _save_tiny_hf_tokenizer(tmp_path / "tok", eos=True)
    records = train(tmp_path / "run", FAST + [
        "data=hf", f"data.hf_dataset_or_datasets={path}", "data.streaming=true", "data.prefetch=true",
        f"tokenizer.tokenizer_name_or_path={tmp_path / 'tok'}", "tokens.sequence_length=8",
        "tokens.train_steps=3", "tokens.val_check_interval=0", "optimizer.learning_rate_scheduler.lr_warmup_steps=0"])
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 3 and all(np.isfinite(losses)) and losses[0] > 5.0   # ~ln(320) at init
    assert np.isfinite(records[-1]["eval_loss"]) and all(r["data_wait_sec"] >= 0 for r in records if "loss" in r)


def test_names_that_look_local_never_go_to_the_hub(tmp_path, monkeypatch):
    from nanoexp.data.hf_dataset import load_hf_dataset, looks_local
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for name in ["data/nope.jsonl", "nope.parquet", "./x", "/abs/x", "~/x", "data/folder", "a/b/c"]:
        assert looks_local(name), name
        with pytest.raises(FileNotFoundError, match="no such file or folder"):
            load_hf_dataset(name)
    for hub_id in ["wikitext", "HuggingFaceFW/fineweb"]:   # a name or org/name without a local parent
        assert not looks_local(hub_id), hub_id
