"""Tests of the data pipeline: tokenizers, built-in corpus, packing, sampler and loaders."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoexp.data import (
    ByteTokenizer, GlobalBatchSampler, HFTokenizer, PackedDataset, TrainBatches, build_builtin_datasets,
    build_tokenizer, eval_batches, load_builtin_documents, shard_for_dp, split_micro_batches,
    split_train_val,
)
from nanoexp.data.loader import IGNORE_INDEX, eval_rounds
from nanoexp.data.corpus import BUILTIN_CORPUS
from tests.helpers import require

SEQ = 8


@pytest.fixture(scope="module")
def small_docs() -> list[str]:
    rng = np.random.default_rng(0)
    words = ["to", "be", "or", "not", "café", "naïve", "—", "🙂", "king", "queen\n"]
    return [" ".join(rng.choice(words, size=int(rng.integers(5, 40)))) for _ in range(12)]


@pytest.fixture(scope="module")
def small_ds(small_docs) -> PackedDataset:
    return PackedDataset(small_docs, ByteTokenizer(), SEQ)


def steps_of(loader: TrainBatches, n: int) -> list[list[dict]]:
    return [loader.next_step() for _ in range(n)]


def ids_of(step: list[dict]) -> torch.Tensor:
    return torch.cat([mb["input_ids"] for mb in step])


# --- tokenizers -------------------------------------------------------------------------------

def test_byte_tokenizer_round_trip():
    tok = build_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.name == "byte"
    assert (tok.vocab_size, tok.eod_id) == (257, 256)
    text = "Hello, wörld! — 你好 🙂\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.encode_array(text).tolist() == ids
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eod_id]) == text          # special ids are skipped
    assert tok.decode(ids[:-2] + [0xE4]).endswith("\ufffd")  # broken UTF-8 is replaced


def test_missing_tokenizer_path_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.tokenizer_name_or_path"):
        build_tokenizer(str(tmp_path / "nope"))


def _save_tiny_hf_tokenizer(folder, eos: bool) -> None:
    tokenizers = require("tokenizers")
    transformers = require("transformers")
    from tokenizers import models, pre_tokenizers, trainers

    raw = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["[UNK]", "</s>"] if eos else ["[UNK]"]
    raw.train_from_iterator(["to be or not to be", "that is the question", "the king is dead"],
                            trainers.WordLevelTrainer(special_tokens=special))
    kwargs = {"eos_token": "</s>"} if eos else {}
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", **kwargs)
    fast.save_pretrained(str(folder))


def test_hf_tokenizer_matches_transformers(tmp_path):
    _save_tiny_hf_tokenizer(tmp_path, eos=True)
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    tok = build_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer) and tok.name == str(tmp_path)
    text = "to be or not to be , the king"
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False)
    assert tok.encode_array(text).tolist() == tok.encode(text)
    assert tok.eod_id == ref.eos_token_id and tok.vocab_size == len(ref)
    assert tok.decode(tok.encode("the king")) == ref.decode(ref.encode("the king", add_special_tokens=False))
    ds = PackedDataset(["to be or not to be", "the king is dead"], tok, 3)
    assert (ds.tokens == tok.eod_id).sum() == 2


def test_hf_tokenizer_without_eos_is_rejected(tmp_path):
    _save_tiny_hf_tokenizer(tmp_path, eos=False)
    with pytest.raises(ValueError, match="eos"):
        HFTokenizer(tmp_path)


# --- corpus and split -------------------------------------------------------------------------

def test_builtin_corpus():
    docs = load_builtin_documents()
    assert len(docs) == 42 and all(len(d) > 1000 for d in docs)
    assert docs == load_builtin_documents()
    assert BUILTIN_CORPUS.stat().st_size < 2_000_000
    assert "Gutenberg" not in "".join(docs)
    assert sum(d.startswith("HAMLET") for d in docs) == 1  # one text per work


def test_validation_is_held_out():
    docs = load_builtin_documents()
    train, val = split_train_val(docs, 0.05)
    assert len(train) == len(val) == len(docs)
    assert all(t + v == d for t, v, d in zip(train, val, docs))
    assert 0.04 < sum(map(len, val)) / sum(map(len, docs)) < 0.06
    all_train = "\x00".join(train)
    assert not any(v in all_train for v in val)
    assert split_train_val(docs, 0.05) == (train, val)
    assert split_train_val(docs, 0.0) == (docs, [])


def test_byte_packing_takes_the_array_path():
    """Packing the corpus is fast because each document is encoded once, straight into an array
    (`encode_array`: no Python loop over its tokens), never through the list of ids of `encode`."""
    class Counting(ByteTokenizer):
        def __init__(self):
            self.arrays = 0

        def encode(self, text):
            raise AssertionError("packing went through encode(), a Python list per document")

        def encode_array(self, text):
            self.arrays += 1
            return super().encode_array(text)

    docs = load_builtin_documents()
    tokenizer = Counting()
    ds = PackedDataset(docs, tokenizer, 1024)
    assert tokenizer.arrays == len(docs)
    assert ds.tokens.dtype == np.int32
    assert ds.num_tokens == sum(len(d.encode("utf-8")) for d in docs) + len(docs)
    eod = np.flatnonzero(ds.tokens == ByteTokenizer.eod_id)   # the documents' bytes, each followed by eod
    assert len(eod) == len(docs) and eod[-1] == len(ds.tokens) - 1
    assert bytes(ds.tokens[:eod[0]].astype(np.uint8)) == docs[0].encode("utf-8")


# --- packing ----------------------------------------------------------------------------------

def test_packing_overlaps_by_one_and_covers_all_tokens(small_docs, small_ds):
    tok = ByteTokenizer()
    stream = []
    for d in small_docs:
        stream += tok.encode(d) + [tok.eod_id]
    assert small_ds.tokens.tolist() == stream
    n = len(small_ds)
    assert n == (len(stream) - 1) // SEQ
    samples = [small_ds[i] for i in range(n)]
    assert all(s.dtype == torch.long and s.shape == (SEQ + 1,) for s in samples)
    for a, b in zip(samples, samples[1:]):
        assert a[-1] == b[0]
    rebuilt = torch.cat([s[:-1] for s in samples] + [samples[-1][-1:]]).tolist()
    assert rebuilt == stream[:n * SEQ + 1]
    with pytest.raises(IndexError):
        small_ds[n]


def test_build_builtin_datasets():
    train, val = build_builtin_datasets(ByteTokenizer(), 64, 0.05)
    assert len(train) > 10 * len(val) > 0
    assert train[0].shape == (65,)


# --- sampler ----------------------------------------------------------------------------------

def test_sampler_is_deterministic_and_a_permutation_per_epoch():
    n = 37
    s = GlobalBatchSampler(n, 8, seed=3)
    order = s.indices(0, 3 * n)
    assert order == GlobalBatchSampler(n, 8, seed=3).indices(0, 3 * n)
    assert order != GlobalBatchSampler(n, 8, seed=4).indices(0, 3 * n)
    epochs = [order[e * n:(e + 1) * n] for e in range(3)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    assert epochs[0] != epochs[1]
    # Any window, even across an epoch boundary, reads the same order.
    assert s.indices(30, 20) == order[30:50]
    assert s.global_batch(5) == order[40:48]


def test_shard_and_split():
    g = list(range(8))
    assert [shard_for_dp(g, r, 4) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split_micro_batches([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]
    with pytest.raises(ValueError):
        shard_for_dp(g, 0, 3)
    with pytest.raises(ValueError):
        split_micro_batches([1, 2, 3], 2)


# --- loaders ----------------------------------------------------------------------------------

@pytest.mark.parametrize("prefetch", [False, True])
def test_dp_split_invariance(small_docs, prefetch):
    small_ds = PackedDataset(small_docs[:2], ByteTokenizer(), SEQ)
    G, steps = 8, 6  # 6 * 8 samples spans more than one epoch of this tiny dataset
    assert steps * G > len(small_ds) >= G
    reference = None
    for dp, mbs in [(1, 8), (1, 4), (1, 1), (2, 4), (2, 2), (4, 1), (2, 1), (8, 1)]:
        per_rank = []
        for rank in range(dp):
            with TrainBatches(small_ds, G, mbs, rank, dp, seed=7, prefetch=prefetch) as loader:
                run = steps_of(loader, steps)
            assert all(len(step) == G // (dp * mbs) for step in run)
            assert all(mb["input_ids"].shape == (mbs, SEQ) for step in run for mb in step)
            per_rank.append(run)
        seq = [torch.cat([ids_of(per_rank[r][s]) for r in range(dp)]) for s in range(steps)]
        if reference is None:
            reference = seq
        assert all(torch.equal(a, b) for a, b in zip(seq, reference)), (dp, mbs)


def test_labels_are_inputs_shifted_by_one(small_ds):
    with TrainBatches(small_ds, 4, 2, 0, 1, seed=0, prefetch=False) as loader:
        for mb in loader.next_step():
            assert torch.equal(mb["input_ids"][:, 1:], mb["labels"][:, :-1])
            assert mb["input_ids"].dtype == mb["labels"].dtype == torch.long


def test_resume_and_prefetch_give_identical_batches(small_ds):
    G = 8
    with TrainBatches(small_ds, G, 2, 1, 2, seed=11, prefetch=True) as a:
        steps_of(a, 3)
        assert a.consumed_samples == 3 * G
        fourth = a.next_step()
        assert isinstance(a.last_wait_sec, float) and a.last_wait_sec >= 0.0
    for prefetch in (True, False):
        with TrainBatches(small_ds, G, 2, 1, 2, seed=11, consumed_samples=3 * G, prefetch=prefetch) as b:
            resumed = b.next_step()
            assert b.consumed_samples == 4 * G
            assert isinstance(b.last_wait_sec, float) and b.last_wait_sec >= 0.0
        assert all(torch.equal(x[k], y[k]) for x, y in zip(fourth, resumed) for k in ("input_ids", "labels"))


def test_close_stops_prefetch_thread(small_ds):
    loader = TrainBatches(small_ds, 8, 2, 0, 1, seed=0, prefetch=True)
    loader.next_step()
    thread = loader._thread
    loader.close()
    loader.close()
    assert thread is not None and not thread.is_alive()
    with pytest.raises(RuntimeError):
        loader.next_step()


def test_unclosed_loader_is_collected(small_ds):
    import gc

    loader = TrainBatches(small_ds, 8, 2, 0, 1, seed=0, prefetch=True)
    thread = loader._thread
    del loader
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_eval_batches_do_not_depend_on_the_layout(small_ds):
    G = 8
    reference = [mb["input_ids"] for mb in eval_batches(small_ds, G, 8, 3, 0, 1, SEQ)]
    for dp, mbs in [(2, 2), (4, 1), (2, 4), (1, 2)]:
        per_rank = [eval_batches(small_ds, G, mbs, 3, r, dp, SEQ) for r in range(dp)]
        assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == 3 * G // (dp * mbs)
        seen = sorted(tuple(row.tolist()) for b in per_rank for mb in b for row in mb["input_ids"])
        assert seen == sorted(tuple(row.tolist()) for batch in reference for row in batch)
    expected = sorted(tuple(small_ds[i][:-1].tolist()) for i in range(3 * G))
    assert sorted(tuple(row.tolist()) for batch in reference for row in batch) == expected


def test_eval_batches_cover_every_sample_and_pad_the_last_batch(small_ds):
    """A held-out set that is not a multiple of the global batch (or smaller than one) is evaluated
    whole: the last global batch is filled with padding rows whose labels are all IGNORE_INDEX."""
    n = len(small_ds)
    for G in (4, 8, 4 * (n // 4 + 1)):   # divisible by dp=2 x mbs=2; the last one is larger than the set
        per_rank = [eval_batches(small_ds, G, 2, None, r, 2, SEQ) for r in range(2)]
        # Rank 0 holds the first half of each global batch, rank 1 the second: interleave them back.
        rounds = [mb["labels"] for r in range(2) for mb in per_rank[r]]
        half = len(rounds) // 2
        labels = torch.cat([x for b in range(half // (G // 4)) for r in range(2)
                            for x in rounds[r * half + b * (G // 4):r * half + (b + 1) * (G // 4)]])
        assert len(labels) == G * -(-n // G)
        padded = (labels == IGNORE_INDEX).all(dim=1)
        assert padded.sum() == len(labels) - n and not padded[:n].any()   # padding only after the last sample
        assert [tuple(r.tolist()) for r in labels[:n]] == [tuple(small_ds[i][1:].tolist()) for i in range(n)]
    assert eval_rounds(n, 4, 1) == 1 and eval_rounds(n, 1, 2) == 2 and eval_rounds(n, 1, None) == n
