"""Nanoset reading, blending, the sample order over blends, bad-data errors, and a blended training run."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from nanoexp.data import (
    BlendedOrder, ByteTokenizer, ConcatDataset, Nanoset, NanosetWriter, TokenWindows, TrainBatches,
)
from nanoexp.data.blend import block_counts
from nanoexp.checks import check_config
from tests.data_files import byte_stream, random_documents
from tests.helpers import FAST, compose_config, start_error, train

SEQ = 8


def write_nanoset(folder, documents: list[str]) -> str:
    tok = ByteTokenizer()
    with NanosetWriter(folder, tok.name, tok.vocab_size, tok.eod_id) as w:
        w.add(tok.encode_batch(documents))
    return str(folder)


@pytest.fixture
def two_folders(tmp_path):
    return (write_nanoset(tmp_path / "web", random_documents(60, seed=1)),
            write_nanoset(tmp_path / "code", random_documents(30, seed=2)))


def test_nanoset_samples_equal_packed_stream_and_hold_out_a_tail(tmp_path):
    docs = random_documents(50)
    folder = write_nanoset(tmp_path / "n", docs)
    stream = np.array(byte_stream(docs))
    whole = Nanoset(folder, SEQ, "train", validation_fraction=0.0)
    reference = TokenWindows(stream, SEQ)
    assert isinstance(whole.tokens, np.memmap) and len(whole) == len(reference)
    assert all(torch.equal(whole[i], reference[i]) for i in range(len(whole)))
    train, val = Nanoset(folder, SEQ, "train", 0.1), Nanoset(folder, SEQ, "validation", 0.1)
    assert np.array_equal(np.concatenate([train.tokens, val.tokens]), stream)
    assert train.tokens[-1] == 256                        # the cut falls on a document boundary
    longest = max(len(d.encode()) + 1 for d in docs)   # the tail is 10 % of the tokens, less < one document
    assert 0.1 * len(stream) - longest < len(val.tokens) <= 0.1 * len(stream) + 1


def test_blend_proportions_epochs_and_resume():
    sizes, weights = [50, 13, 200], [0.5, 0.2, 0.3]
    order = BlendedOrder(sizes, weights, seed=5)
    n = 6 * 4096 + 1000
    idx = np.array(order.indices(0, n))
    owner = np.searchsorted(np.cumsum(sizes), idx, side="right")
    # Whole blocks hold exactly the rounded counts; tolerance: one block's rounding (1/4096)
    # plus the partial block (1000 positions spread by chance, bounded by 1000/n).
    assert np.bincount(owner[:6 * 4096]).tolist() == (6 * block_counts(weights, 4096)).tolist()
    share = np.bincount(owner) / n
    assert np.allclose(share, weights, atol=1 / 4096 + 1000 / n)
    # Each dataset is read as shuffled epochs: every run of sizes[d] draws is a permutation.
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    for d, size in enumerate(sizes):
        draws = idx[owner == d] - offsets[d]
        for e in range(len(draws) // size):
            assert sorted(draws[e * size:(e + 1) * size]) == list(range(size))
        assert not np.array_equal(draws[:size], draws[size:2 * size])
    # Deterministic, seed-driven, and any window can be produced directly (resume).
    assert np.array_equal(BlendedOrder(sizes, weights, seed=5).indices(0, n), idx)
    assert not np.array_equal(BlendedOrder(sizes, weights, seed=6).indices(0, 500), idx[:500])
    fresh = BlendedOrder(sizes, weights, seed=5)
    assert fresh.indices(12_000, 5000) == idx[12_000:17_000].tolist()


def test_blended_batches_are_dp_split_invariant_and_resume(two_folders):
    data = ConcatDataset([Nanoset(f, SEQ) for f in two_folders], [0.7, 0.3])
    G, steps = 8, 4
    reference = None
    for dp, mbs in [(1, 8), (2, 2), (4, 1), (8, 1)]:
        per_rank = []
        for rank in range(dp):
            with TrainBatches(data, G, mbs, rank, dp, seed=3, prefetch=rank == 0) as loader:
                per_rank.append([torch.cat([mb["input_ids"] for mb in loader.next_step()]) for _ in range(steps)])
        merged = [torch.cat([per_rank[r][s] for r in range(dp)]) for s in range(steps)]
        reference = reference or merged
        assert all(torch.equal(a, b) for a, b in zip(merged, reference)), (dp, mbs)
    # Resume on another dp size: rank 1 of 2 from 3 consumed steps = its half of step 4.
    with TrainBatches(data, G, 2, 1, 2, seed=3, consumed_samples=3 * G) as loader:
        assert torch.equal(torch.cat([mb["input_ids"] for mb in loader.next_step()]), reference[3][4:])


# --- bad data: every case stops at start-up with the file in the message ---------------------------

def nanoset_cfg(folders, *extra):
    return compose_config(FAST + ["data=nanoset", f"data.dataset_folder=[{','.join(folders)}]", *extra])


def test_config_only_errors_name_the_key(two_folders):
    assert "data.dataset_weights has 1 values" in start_error(nanoset_cfg(two_folders, "data.dataset_weights=[1.0]"))
    assert "every weight must be positive" in start_error(nanoset_cfg(two_folders, "data.dataset_weights=[1,0]"))
    assert "data.dataset_folder is empty" in start_error(compose_config(FAST + ["data=nanoset"]))
    assert "data.name=web" in start_error(compose_config(FAST + ["data.name=web"]))
    check_config(nanoset_cfg(two_folders, "data.dataset_weights=[0.7,0.3]"), None)   # the good config passes


def test_bad_nanoset_files_are_named(two_folders, tmp_path):
    web, code = two_folders
    assert f"{tmp_path}/missing does not exist" in start_error(nanoset_cfg([web, str(tmp_path / "missing")]))

    (tmp_path / "code" / "tokens.bin").write_bytes((tmp_path / "code" / "tokens.bin").read_bytes()[:-4])
    assert "code/tokens.bin has" in start_error(nanoset_cfg([web, code]))

    meta_path = tmp_path / "web" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps(dict(meta, vocab_size=70_000)))
    assert "web/metadata.json: dtype uint16 cannot hold" in start_error(nanoset_cfg([web]))
    meta_path.write_text(json.dumps(dict(meta, vocab_size=200, tokenizer="other")))
    message = start_error(nanoset_cfg([web]))
    assert "web/metadata.json: made with tokenizer 'other' (vocab 200" in message
    meta_path.write_text(json.dumps(dict(meta, vocab_size=400)))
    assert "vocab_size 400 exceeds model.model_config.vocab_size=257" in start_error(nanoset_cfg([web]))
    # A metadata.json of garbage, of another shape, without the keys, with a dtype a Nanoset never has: named.
    for content, said in [("garbage\n\x00", "not valid JSON (Expecting value: line 1 column 1 (char 0)); re-run "
                           "scripts/preprocess_data.py"),
                          ("[1, 2]", "format None version None, this reader needs 'nanoset' version 1"),
                          (json.dumps({k: meta[k] for k in ("format", "format_version", "tokenizer")}),
                           "it lacks vocab_size, eod_id, dtype, num_tokens, num_documents"),
                          (json.dumps(dict(meta, dtype="float32")), "dtype 'float32', a Nanoset's tokens are uint16 "
                           "or uint32")]:
        meta_path.write_text(content)
        assert f"data: data.dataset_folder: {meta_path}: {said}" in start_error(nanoset_cfg([web]))
    meta_path.unlink()
    assert "web/metadata.json is missing" in start_error(nanoset_cfg([web]))

    # A tokenizer larger than the model's vocabulary (a config check with the tokenizer loaded).
    assert "model.model_config.vocab_size=200" in start_error(
        compose_config(FAST + ["model.model_config.vocab_size=200"]))


def test_empty_and_tiny_datasets_are_named(tmp_path):
    empty = write_nanoset(tmp_path / "empty", [])
    assert "empty: the dataset is empty" in start_error(nanoset_cfg([empty]))
    tiny = write_nanoset(tmp_path / "tiny", ["to be"] * 2)   # 12 tokens
    error = start_error(nanoset_cfg([tiny], "data.validation_fraction=0.01"))
    assert "tiny (train): 12 tokens are too few for one sample of sequence length 32" in error
    assert "tokens.sequence_length=32" in error   # the key to change
    small = write_nanoset(tmp_path / "small", ["to be or not to be"] * 12)  # 228 tokens: 4 training samples
    assert "fewer than one global batch (8)" in start_error(nanoset_cfg([small], "data.validation_fraction=0.3"))


def test_training_on_two_blended_nanosets(two_folders, tmp_path):
    records = train(tmp_path / "run", FAST + [
        "data=nanoset", f"data.dataset_folder=[{','.join(two_folders)}]", "data.dataset_weights=[0.7,0.3]",
        "tokens.train_steps=3", "tokens.val_check_interval=0", "optimizer.learning_rate_scheduler.lr_warmup_steps=0"])
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 3 and all(np.isfinite(losses)) and losses[0] > 5.0   # ~ln(320) at init
    assert np.isfinite(records[-1]["eval_loss"]) and all(r["data_wait_sec"] >= 0 for r in records if "loss" in r)
