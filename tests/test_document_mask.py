"""Document masking (model.attention_mask=document): documents and positions cut at the end-of-document id, a
document packed after another scored as if it started the sample, single documents unchanged, and the loader and
evaluation carrying the documents. Parity across layouts is in tests/test_parallel.py (`-k document`), the HF
export of a model trained this way in tests/test_hf_conversion.py."""
import torch

from nanoexp.data import ByteTokenizer, PackedDataset
from nanoexp.data.loader import TrainBatches, document_positions, eval_batches
from nanoexp.model.init import init_weights
from nanoexp.model.llama import LlamaForCausalLM, LlamaShape
from tests.data_files import random_documents
from tests.helpers import FAST, train, train_losses
from tests.test_nanoset import write_nanoset

EOD = ByteTokenizer.eod_id
SHAPE = LlamaShape(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=320, max_position_embeddings=64)
# float32, the same sums over a different set of masked keys (exact zeros) in another order: rounding only.
ATOL = 1e-5


def test_documents_start_after_each_end_of_document_id():
    ids = torch.tensor([[5, EOD, 7, 8, EOD, 9], [1, 2, 3, 4, 5, 6]])
    positions, documents = document_positions(ids, EOD)
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]]
    assert documents.tolist() == [[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]]


def model() -> LlamaForCausalLM:
    m = LlamaForCausalLM(SHAPE).eval()
    init_weights(m, std=0.08, seed=3)
    return m


def token_losses(m, ids: torch.Tensor, documents: bool) -> torch.Tensor:
    inputs, labels = ids[:, :-1], ids[:, 1:]
    positions, document_ids = document_positions(inputs, EOD)
    extra = dict(position_ids=positions, document_ids=document_ids) if documents else {}
    with torch.no_grad():
        return m(input_ids=inputs, labels=labels, **extra)[0]


def test_a_document_after_another_scores_as_if_it_started_the_sample():
    gen = torch.Generator().manual_seed(0)
    first, second, after = (torch.randint(0, 256, (n,), generator=gen) for n in (11, 17, 20))
    eod = torch.tensor([EOD])
    packed = torch.cat([first, eod, second, eod, after])[None]     # `second` starts at index 12
    alone = torch.cat([second, eod, after, first])[None]            # `second` starts the sample
    m = model()
    # Targets of `second`'s tokens (its last one predicts its eod): 17 losses at inputs 12..28 vs 0..16.
    masked = token_losses(m, packed, documents=True)[12:29]
    torch.testing.assert_close(masked, token_losses(m, alone, documents=True)[:17], atol=ATOL, rtol=0)
    torch.testing.assert_close(masked, token_losses(m, alone, documents=False)[:17], atol=ATOL, rtol=0)
    # Without the mask the earlier document changes them: the test can tell the two apart.
    assert (token_losses(m, packed, documents=False)[12:29] - masked).abs().max() > 1e-3


def test_a_single_document_scores_as_with_causal_attention():
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))   # no end-of-document id
    m = model()
    torch.testing.assert_close(token_losses(m, ids, documents=True), token_losses(m, ids, documents=False),
                               atol=ATOL, rtol=0)


def test_training_and_evaluation_batches_carry_documents():
    docs = ["to be or not to be", "that is the question", "whether 'tis nobler in the mind"] * 4
    dataset = PackedDataset(docs, ByteTokenizer(), 16)
    with TrainBatches(dataset, 4, 2, 0, 1, seed=0, prefetch=False, eod_id=EOD) as loader:
        steps = [loader.next_step() for _ in range(3)]
    for batch in [mb for step in steps for mb in step] + eval_batches(dataset, 4, 2, None, 0, 1, 16, eod_id=EOD):
        positions, documents = document_positions(batch["input_ids"], EOD)
        assert torch.equal(batch["position_ids"], positions) and torch.equal(batch["document_ids"], documents)
    assert any(int(mb["document_ids"].max()) > 0 for step in steps for mb in step)   # boundaries inside samples
    with TrainBatches(dataset, 4, 2, 0, 1, seed=0, prefetch=False) as loader:   # causal: the batches as before
        assert set(loader.next_step()[0]) == {"input_ids", "labels"}


def test_document_masking_trains_and_differs_from_causal(tmp_path):
    # Documents of ~109 bytes: a boundary in about one 32-token sample of three.
    folder = write_nanoset(tmp_path / "short", random_documents(300, seed=5))
    run = FAST + ["tokens.train_steps=3", "tokens.val_check_interval=0", "data=nanoset",
                  f"data.dataset_folder=[{folder}]"]
    document = train(tmp_path / "document", run + ["model.attention_mask=document"])
    causal = train(tmp_path / "causal", run)
    # Same samples, attention cut at the packed boundaries: other losses, evaluation included.
    assert len(train_losses(document)) == 3 and train_losses(document) != train_losses(causal)
    assert document[-1]["eval_loss"] != causal[-1]["eval_loss"]
