"""Hugging Face export and import against transformers' LlamaForCausalLM, the byte tokenizer
files against nanoexp's ByteTokenizer, KV-cache decoding and evaluate.py against full forwards."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer
from transformers import LlamaForCausalLM as HFLlama

from nanoexp.model.placement import placement
from nanoexp.data.tokenizer import ByteTokenizer
from nanoexp.interop.hf import load_hf_weights
from nanoexp.model.generation import KVCache, forward_with_cache, generate
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.runtime.build import build_model, load_single_process
from nanoexp.interop.hf_checkpoint import convert_to_hf
from tests.distributed import run_distributed
from tests.helpers import FAST, compose_config, train
from tests.test_checkpoint import ROOT

# float32, the same math in another order: the bound tests/test_model_hf.py uses.
LOGITS_ATOL = 1e-5
TEXT = "To be, or not to be: that is the question — naïve café, 日本語 🙂\n"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tied-embedding checkpoint written by a tp2 x pp2 run with interleaved chunks, exported to HF (read back
    on one process, the model is one chunk again: load_single_process builds it for one process's layout)."""
    root = tmp_path_factory.mktemp("hf")
    train(root / "run", FAST + ["tokens.train_steps=2", "tokens.val_check_interval=0", "parallelism=dp1tp2pp2",
                                "parallelism.pp_engine=interleaved_1f1b", "parallelism.pp_virtual_stages=2",
                                "optimizer.learning_rate_scheduler.lr_warmup_steps=1",
                                "model.model_config.tie_word_embeddings=true"])
    ckpt = root / "run" / "checkpoints" / "2"
    convert_to_hf(str(ckpt), str(root / "hf"))
    return ckpt, root / "hf"


def test_hf_model_gives_nanoexp_logits(exported):
    ckpt, hf_dir = exported
    ours, _ = load_single_process(str(ckpt))
    hf = HFLlama.from_pretrained(str(hf_dir)).eval()
    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(input_ids=ids), atol=LOGITS_ATOL, rtol=0)


def test_hf_export_of_a_document_masked_model_scores_a_single_document_like_nanoexp(tmp_path):
    """Trained with model.attention_mask=document (tp2), exported: HF's causal attention over one document (no
    end-of-document id inside) gives the logits nanoexp computes with that document's ids and positions."""
    from nanoexp.data.loader import document_positions

    train(tmp_path / "run", FAST + ["tokens.train_steps=2", "tokens.val_check_interval=0", "parallelism=dp1tp2pp1",
                                    "optimizer.learning_rate_scheduler.lr_warmup_steps=1",
                                    "model.attention_mask=document"])
    ckpt = tmp_path / "run" / "checkpoints" / "2"
    convert_to_hf(str(ckpt), str(tmp_path / "hf"))
    ours, cfg = load_single_process(str(ckpt))
    assert cfg.model.attention_mask == "document"
    ids = torch.tensor([ByteTokenizer().encode(TEXT)])
    positions, documents = document_positions(ids, ByteTokenizer.eod_id)
    hf = HFLlama.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(input_ids=ids, position_ids=positions, document_ids=documents),
                                   atol=LOGITS_ATOL, rtol=0)


def test_mup_export_bakes_the_multipliers_into_the_weights(tmp_path):
    """A tied µP model (m = 64/16 = 4, attention 1/16): transformers' Llama, which knows no multipliers,
    gives the same logits from the exported weights; the tied head is exported as its own tensor.
    KV-cache decoding applies the same multipliers as the full forward."""
    train(tmp_path / "run", FAST + ["tokens.train_steps=2", "tokens.val_check_interval=0",
                                    "optimizer.learning_rate_scheduler.lr_warmup_steps=1",
                                    "model.model_config.tie_word_embeddings=true", "model.parametrization=mup",
                                    "model.mup.base_width=16"])
    convert_to_hf(str(tmp_path / "run" / "checkpoints" / "2"), str(tmp_path / "hf"))
    ours, _ = load_single_process(str(tmp_path / "run" / "checkpoints" / "2"))
    hf = HFLlama.from_pretrained(str(tmp_path / "hf")).eval()
    assert hf.config.tie_word_embeddings is False
    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(input_ids=ids), atol=LOGITS_ATOL, rtol=0)
    cache = KVCache()
    steps = [forward_with_cache(ours, ids[:, :16], cache)]
    steps += [forward_with_cache(ours, ids[:, i:i + 1], cache) for i in range(16, 32)]
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(steps, dim=1), ours(input_ids=ids), atol=LOGITS_ATOL, rtol=0)


def test_exported_files_get_the_usual_permissions(exported):
    """Files written for others to read get the umask's normal mode, not a temporary file's 0600."""
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(exported[1]):
        assert os.stat(exported[1] / name).st_mode & 0o777 == 0o666 & ~umask, name


def test_byte_tokenizer_files_encode_like_nanoexp(exported):
    tok = AutoTokenizer.from_pretrained(str(exported[1]))
    assert tok.encode(TEXT, add_special_tokens=False) == ByteTokenizer().encode(TEXT)
    assert tok.decode(ByteTokenizer().encode(TEXT)) == TEXT
    assert tok.eos_token_id == ByteTokenizer.eod_id


def _import_on_tp2(rank, world_size, hf_dir):
    cfg = compose_config(FAST + ["model.model_config.tie_word_embeddings=true", "parallelism=dp1tp2pp1"])
    ctx = ParallelContext(Layout(tp=2))
    model = build_model(cfg, ctx)
    load_hf_weights(model, hf_dir)
    return {n: p.detach() for n, p in model.named_parameters()}


def test_hf_weights_load_back_on_another_layout(exported):
    """nanoexp -> HF -> nanoexp (tp2): each rank holds its slice of the exported tensors."""
    ours, _ = load_single_process(str(exported[0]))
    full = dict(ours.named_parameters())
    shards = run_distributed(_import_on_tp2, 2, str(exported[1]))
    for name, param in full.items():
        dim = placement(param).split_dim
        joined = (torch.cat([torch.from_numpy(s[name]) for s in shards], dim=dim) if dim is not None
                  else torch.from_numpy(shards[0][name]))
        assert torch.equal(joined, param.detach()), name


def test_kv_cache_decoding_matches_full_forward(exported):
    model, _ = load_single_process(str(exported[0]))
    ids = torch.randint(0, 257, (1, 24), generator=torch.Generator().manual_seed(1))
    cache = KVCache()
    steps = [forward_with_cache(model, ids[:, :16], cache)]
    steps += [forward_with_cache(model, ids[:, i:i + 1], cache) for i in range(16, 24)]
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(steps, dim=1), model(input_ids=ids), atol=LOGITS_ATOL, rtol=0)
    greedy = generate(model, [84, 111], 8, vocab_size=257)
    sequence = [84, 111]
    with torch.no_grad():   # the reference: argmax of a full forward over the growing sequence
        for _ in range(8):
            sequence.append(int(model(input_ids=torch.tensor([sequence]))[0, -1, :257].argmax()))
    assert greedy == sequence[2:]


@pytest.mark.slow
def test_evaluate_script_reports_mean_next_token_loss(exported, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 3, encoding="utf-8")
    out = subprocess.run([sys.executable, "scripts/evaluate.py", str(exported[0]), "--text-file", str(text)],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    ids = torch.tensor([ByteTokenizer().encode(TEXT * 3)])
    model, cfg = load_single_process(str(exported[0]))
    window, total = cfg.tokens.sequence_length, 0.0
    with torch.no_grad():   # reference: one window at a time, summed cross-entropy
        for start in range(0, ids.shape[1] - 1, window):
            chunk = ids[:, start:start + window + 1]
            total += F.cross_entropy(model(input_ids=chunk[:, :-1])[0], chunk[0, 1:], reduction="sum").item()
    assert result["tokens"] == ids.shape[1] - 1
    assert result["loss"] == pytest.approx(total / result["tokens"], abs=1e-6)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
