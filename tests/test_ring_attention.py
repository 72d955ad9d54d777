"""Ring attention (nanoexp/parallel/context_parallel/ring.py) against full-sequence causal attention.

The zig-zag split and its work balance are checked as plain Python; the ring runs on cp forked gloo ranks
and its output and q/k/v gradients, gathered back to the full sequence, are compared with SDPA's
(is_causal=True) on one process. Every point-to-point call is recorded and must equal ring_plan
(nanoexp/verify/context_parallel.py), which p2p_plan.check accepts under NCCL's rules.
"""
from __future__ import annotations

import contextlib
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import nanoexp.parallel.context_parallel.blocks as attention_blocks
from nanoexp.data.loader import document_positions
from nanoexp.model.attention import SDPA, Causal, Documents
from nanoexp.parallel.context_parallel import CP_KERNELS
from nanoexp.parallel.context_parallel.ring import ring_blocks, visibility
from nanoexp.parallel.context_parallel.zigzag import document_starts, rank_chunks, zigzag_indices, zigzag_split
from nanoexp.verify.comm_counter import CommCounter
from nanoexp.verify.context_parallel import ring_plan, zigzag_gather
from nanoexp.verify.p2p_plan import PlanError, check
from tests.distributed import run_distributed
from tests.test_p2p_plan import recorded_p2p

BATCH, SEQ, HEAD_DIM = 2, 32, 8


# -- the split and the work balance (plain Python) --------------------------------------------

def test_zigzag_split_and_gather_round_trip():
    assert [zigzag_indices(8, 2, r).tolist() for r in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert rank_chunks(4, 1) == (1, 6)
    x = torch.randn(2, 24, 3)
    for cp in (1, 2, 3, 4, 6):
        parts = [zigzag_split(x, cp, r) for r in range(cp)]
        assert all(p.shape == (2, 24 // cp, 3) for p in parts)
        assert torch.equal(zigzag_gather(parts), x)
    heads_first = torch.randn(2, 4, 16, 8)   # [b, heads, s, d]: the sequence is dimension 2
    assert torch.equal(zigzag_gather([zigzag_split(heads_first, 4, r, dim=2) for r in range(4)], dim=2), heads_first)
    with pytest.raises(ValueError, match="multiple of 2·cp"):
        zigzag_indices(12, 4, 0)


def score_elements(blocks, chunk):
    """Attention scores computed: a full block chunk², a diagonal one chunk·(chunk+1)/2."""
    return sum(chunk * (chunk + 1) // 2 if causal else chunk * chunk for _, _, causal in blocks)


def test_zigzag_balances_the_attention_work():
    """Every visible pair of chunks is computed exactly once, by the rank holding its queries, and every rank
    computes the same number of scores (1/cp of the causal triangle). The contiguous split (rank r holding
    chunks 2r and 2r+1) gives the last rank more than cp times the first rank's work."""
    chunk = 16
    for cp in range(1, 9):
        pairs, work = [], []
        for r in range(cp):
            steps = ring_blocks(cp, r)
            assert len(steps) == cp
            pairs += [(rank_chunks(cp, r)[qi], rank_chunks(cp, (r - t) % cp)[ki], causal)
                      for t, blocks in enumerate(steps) for qi, ki, causal in blocks]
            work.append(score_elements([b for blocks in steps for b in blocks], chunk))
        visible = [(q, k, visibility(q, k) == "causal") for q in range(2 * cp) for k in range(2 * cp) if k <= q]
        assert sorted(pairs) == sorted(visible)
        seq = 2 * cp * chunk
        assert work == [seq * (seq + 1) // 2 // cp] * cp

        contiguous = [score_elements([(0, 0, visibility(q, k) == "causal") for q in (2 * r, 2 * r + 1)
                                      for k in range(2 * cp) if visibility(q, k)], chunk) for r in range(cp)]
        assert sum(contiguous) == sum(work)
        if cp > 1:
            assert max(contiguous) / min(contiguous) > cp


# -- the plan under NCCL's rules --------------------------------------------------------------

def test_ring_plan_passes_nccl_rules_and_an_unpaired_order_does_not():
    # cp=2: forward, one K/V exchange; backward, K/V out, then the dK/dV accumulator home to its owner.
    assert ring_plan(2, 10, 20) == [
        [[("send", 1, 10), ("recv", 1, 10)], [("send", 1, 10), ("recv", 1, 10)], [("send", 1, 20), ("recv", 1, 20)]],
        [[("send", 0, 10), ("recv", 0, 10)], [("send", 0, 10), ("recv", 0, 10)], [("send", 0, 20), ("recv", 0, 20)]]]
    assert ring_plan(1) == [[]]
    for cp in range(2, 9):
        # named: every receive also gets the block (and pass, step) it expects
        assert check(ring_plan(cp, named=True)) == cp * 3 * (cp - 1)   # cp − 1 forward, 2(cp − 1) backward
        # posting each exchange's send before its receive, as two waited batches, deadlocks on the ring
        unpaired = [[part for b in batches for part in ([op for op in b if op[0] == "send"],
                                                        [op for op in b if op[0] == "recv"])]
                    for batches in ring_plan(cp)]
        with pytest.raises(PlanError, match="deadlock"):
            check(unpaired)
    # per rank: K/V sent cp − 1 times in each pass, the dK/dV accumulator cp − 1 times
    plan4 = ring_plan(4, 1, 1000)
    assert [sum(op[2] for b in batches for op in b if op[0] == "send") for batches in plan4] == [3 * 2 + 3 * 1000] * 4


# -- the ring on gloo against one process -----------------------------------------------------

def make_inputs(heads, kv_heads, dtype, seed=0, gain=1.0):
    """q, k, v, grad_out; q and k times `gain` (scores times gain²: sharper softmaxes)."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(BATCH, heads, SEQ, HEAD_DIM, generator=gen) * gain).to(dtype)
    k, v = (torch.randn(BATCH, kv_heads, SEQ, HEAD_DIM, generator=gen) for _ in range(2))
    k, v = (k * gain).to(dtype), v.to(dtype)
    grad_out = torch.randn(BATCH, heads, SEQ, HEAD_DIM, generator=gen).to(dtype)
    return q, k, v, grad_out


def reference(heads, kv_heads, dtype, scale):
    """Output and q/k/v gradients of SDPA (is_causal) on the whole sequence, one process."""
    q, k, v, grad_out = make_inputs(heads, kv_heads, dtype)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=heads != kv_heads)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def own_group(rank, groups):
    """This rank's cp group of `groups` (lists of ranks; every rank creates every group), or None: the world."""
    if not groups:
        return None
    made = [dist.new_group(ranks) for ranks in groups]
    return next(g for g, ranks in zip(made, groups) if rank in ranks)


def count_scores_in_small_tiles() -> list[int]:
    """In this forked rank: tiles of 3 (chunks of 8 at cp 2, 4 at cp 4: several tiles a block, the last one
    short), and a counter, [scores], of the score elements the tiles compute."""
    scores = [0]
    tile_forward = attention_blocks._tile_forward

    def counting(q, k, v, scale, mask):   # without document masking only diagonal tiles have a mask
        n, m = q.shape[2], k.shape[2]
        scores[0] += q.shape[0] * q.shape[1] * (n * (m + 1) // 2 if mask is not None else n * m)
        return tile_forward(q, k, v, scale, mask)

    attention_blocks._tile_forward = counting
    attention_blocks.TILE = 3
    return scores


# parallelism.cp_mode's attentions share the interface, the layout and the tests parametrized by mode below
CP_ATTENTION = {mode: kernel.attend for mode, kernel in CP_KERNELS.items()}


@contextlib.contextmanager
def posted_communication(mode, group):
    """What the attention posts: the ring's point-to-point batches, or the all-gather attention's
    collectives as (op, group name, payload bytes), filled in on exit."""
    if mode == "ring":
        with recorded_p2p(types.SimpleNamespace(dp=1, tp=1)) as posted:
            yield posted
        return
    posted = []
    with CommCounter({"cp": group} if group is not None else {}) as comm:
        yield posted
    posted += [(op, name, payload) for name, op, payload, _ in comm.records]


def _cp_worker(rank, world_size, cp, cases, groups, mode="ring", autocast=False, gain=1.0):
    """Each case on this rank's cp group: (output, dq, dk, dv) of the local chunks, the communication
    posted and the scores computed. autocast: the forward runs under bf16 autocast, as the trainer's does."""
    group = own_group(rank, groups)
    cp_rank = dist.get_rank(group)
    scores = count_scores_in_small_tiles()
    out = []
    for heads, kv_heads, dtype, scale in cases:
        inputs = make_inputs(heads, kv_heads, dtype, gain=gain)
        q, k, v, grad_out = (zigzag_split(x, cp, cp_rank, dim=2) for x in inputs)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        scores[0] = 0
        with posted_communication(mode, group) as posted:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                result = CP_ATTENTION[mode](q, k, v, group, cp, cp_rank, scale)
            result.backward(grad_out)
        wide = [x.float() if x.dtype == torch.bfloat16 else x for x in (result.detach(), q.grad, k.grad, v.grad)]
        out.append((*wide, posted, scores[0]))   # numpy, which carries them home, has no bfloat16
    return cp_rank, out


# (heads, kv_heads, dtype, scale): MHA and GQA; float64 for a tight check; a µP-style scale 1/d
CASES = [(4, 4, torch.float32, None), (4, 2, torch.float32, None), (6, 2, torch.float64, None),
         (4, 1, torch.float32, 1 / HEAD_DIM)]


def tolerance(dtype):
    # The ring sums each row's softmax in blocks merged with exp(lse differences), SDPA in one go: only the
    # order of the sums differs. Measured worst cases (values and gradients up to ~5): float64 3e-15, float32
    # 2.4e-6 (a few ulps of the largest dv); hence 1e-12 and 1e-5.
    return dict(atol=1e-12, rtol=1e-10) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)


def compare_to_reference(results, cp, cases):
    for c, (heads, kv_heads, dtype, scale) in enumerate(cases):
        expected = reference(heads, kv_heads, dtype, scale)
        for i, name in enumerate(("output", "dq", "dk", "dv")):
            got = zigzag_gather([torch.from_numpy(results[r][c][i]) for r in range(cp)], dim=2)
            torch.testing.assert_close(got, expected[i], **tolerance(dtype), msg=lambda m: f"{name}, case {c}: {m}")


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_matches_sdpa_and_posts_its_plan(cp):
    results = dict(run_distributed(_cp_worker, cp, cp, CASES, None))
    compare_to_reference(results, cp, CASES)
    for c, (heads, kv_heads, dtype, _) in enumerate(CASES):
        element = torch.finfo(dtype).bits // 8
        kv_nbytes = 2 * BATCH * kv_heads * (SEQ // cp) * HEAD_DIM * element   # K and V stacked
        expected = ring_plan(cp, kv_nbytes, kv_nbytes)   # the dK/dV accumulator: float32 or float64 here too
        for r in range(cp):
            assert results[r][c][4] == expected[r]
        # the same attention work on every rank: 1/cp of the causal triangle, forward
        assert [results[r][c][5] for r in range(cp)] == [BATCH * heads * SEQ * (SEQ + 1) // 2 // cp] * cp


def test_ring_attention_on_cp_subgroups():
    """World 4 as two cp=2 groups of non-neighbouring ranks (0, 2) and (1, 3), as a dp × cp grid would make:
    peers are the group's ranks, not the world's."""
    cases = CASES[1:3]
    results = run_distributed(_cp_worker, 4, 2, cases, [[0, 2], [1, 3]])
    for members in ([0, 2], [1, 3]):
        compare_to_reference({results[g][0]: results[g][1] for g in members}, 2, cases)


@pytest.mark.parametrize("mode", list(CP_ATTENTION))
def test_cp1_is_causal_attention_without_communication(mode):
    """No process group exists in this process: any communication would raise."""
    attention = CP_ATTENTION[mode]
    for heads, kv_heads, dtype, scale in CASES:
        q, k, v, grad_out = make_inputs(heads, kv_heads, dtype)
        inputs = [x.requires_grad_() for x in (q, k, v)]
        out = attention(*inputs, scale=scale)
        grads = torch.autograd.grad(out, inputs, grad_out)
        expected_out = SDPA()(*inputs, scale, Causal())
        expected_grads = torch.autograd.grad(expected_out, inputs, grad_out)
        torch.testing.assert_close(out, expected_out, **tolerance(dtype))
        for got, expected in zip(grads, expected_grads):
            torch.testing.assert_close(got, expected, **tolerance(dtype))
    with pytest.raises(ValueError, match="kvh dividing h"):
        attention(torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))


def assert_bf16_as_close_as_sdpa(results, heads, kv_heads, cp, autocast=False, gain=1.0, bound=1.5):
    """The gathered bf16 output and gradients (results[rank][0][:4]) against float64 attention on the same
    bf16 inputs: about as close as bf16 SDPA's on one process (under autocast too, when `autocast`). Measured
    0.57 to 0.98 times SDPA's error for the ring and for the all-gather, the same under autocast, 0.62 to 1.00
    under autocast with scores x 9; 1.5 leaves room for other CPUs' kernels."""
    q, k, v, grad_out = make_inputs(heads, kv_heads, torch.bfloat16, gain=gain)
    expected = {}
    for dtype in (torch.float64, torch.bfloat16):
        inputs = [x.to(dtype).clone().requires_grad_() for x in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast and dtype == torch.bfloat16):
            out = F.scaled_dot_product_attention(*inputs, is_causal=True, enable_gqa=True)
        out.backward(grad_out.to(dtype))
        expected[dtype] = [out.detach()] + [x.grad for x in inputs]
    for i, (exact, sdpa) in enumerate(zip(expected[torch.float64], expected[torch.bfloat16])):
        got = zigzag_gather([torch.from_numpy(results[r][0][i]) for r in range(cp)], dim=2)
        ratio = (got.double() - exact).abs().max() / (sdpa.double() - exact).abs().max()
        assert ratio <= bound, (i, ratio)


def test_bfloat16_ring_is_as_close_to_exact_as_sdpa():
    """In bfloat16 (float32 statistics and accumulators), cp=4; dK/dV travel as float32 (4 bytes)."""
    heads, kv_heads, cp = 4, 2, 4
    results = dict(run_distributed(_cp_worker, cp, cp, [(heads, kv_heads, torch.bfloat16, None)], None))
    assert_bf16_as_close_as_sdpa(results, heads, kv_heads, cp)
    kv_nbytes = 2 * BATCH * kv_heads * (SEQ // cp) * HEAD_DIM
    assert [results[r][0][4] for r in range(cp)] == ring_plan(cp, kv_nbytes * 2, kv_nbytes * 4)


@pytest.mark.parametrize("mode", list(CP_ATTENTION))
def test_bfloat16_under_autocast_is_as_close_to_exact_as_sdpa(mode):
    """The trainer's forward runs under bf16 autocast: the tiles must still compute in float32 (a forward in
    bf16 against a float32 backward disagreed with itself: 34x SDPA's output error at scores x 9). cp=2,
    sharp softmaxes (q and k x 3)."""
    heads, kv_heads, cp, gain = 4, 2, 2, 3.0
    results = dict(run_distributed(_cp_worker, cp, cp, [(heads, kv_heads, torch.bfloat16, None)], None, mode,
                                   True, gain))
    assert_bf16_as_close_as_sdpa(results, heads, kv_heads, cp, autocast=True, gain=gain)


def test_zigzag_balances_the_attention_work_the_contiguous_split_does_not():
    """benchmarks/bench_long_context.py's count of score elements: the zig-zag split gives every rank the same
    work and the ranks together the full causal triangle; a contiguous split leaves the last rank 2cp − 1
    times the first's (to leading order)."""
    from benchmarks.bench_long_context import (balance, contiguous_blocks, contiguous_scores, zigzag_blocks,
                                               zigzag_scores)

    def elements(blocks):   # the blocks the script times hold exactly the scores it counts
        return sum(n * (n + 1) // 2 if causal else n * m for n, m, causal in blocks)

    seq = 4096
    for cp in (2, 4, 8):
        for r in range(cp):
            assert elements(zigzag_blocks(seq, cp, r)) == zigzag_scores(seq, cp, r)
            assert elements(contiguous_blocks(seq, cp, r)) == contiguous_scores(seq, cp, r)
        zigzag = [zigzag_scores(seq, cp, r) for r in range(cp)]
        assert balance(zigzag) == 1 and sum(zigzag) == seq * (seq + 1) // 2
        contiguous = [contiguous_scores(seq, cp, r) for r in range(cp)]
        assert sum(contiguous) == seq * (seq + 1) // 2
        assert 2 * cp - 1.05 < balance(contiguous) < 2 * cp - 1


# -- document masking --------------------------------------------------------------------------

EOD = 1


def packed_documents():
    """position_ids [BATCH, SEQ] of packed samples whose documents start at assorted places: one sample
    with documents of 1, 2 and 12 tokens among longer ones, one with a single document."""
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    ids[0, [0, 2, 5, 17, 29]] = EOD   # documents [0], [1, 2], [3..5], [6..17], [18..29], [30, 31]
    return document_positions(ids, EOD)[0]


def _document_worker(rank, world_size, cp, heads, kv_heads, mode):
    attention_blocks.TILE = 3   # tiles that see no key of their document: the −inf rows of the merge
    q, k, v, grad_out = (zigzag_split(x, cp, rank, dim=2) for x in make_inputs(heads, kv_heads, torch.float64))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    starts = document_starts(zigzag_split(packed_documents(), cp, rank), cp, rank)
    out = CP_ATTENTION[mode](q, k, v, None, cp, rank, None, starts)
    out.backward(grad_out)
    return rank, [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("mode", list(CP_ATTENTION))
@pytest.mark.parametrize("cp, heads, kv_heads", [(2, 4, 2), (4, 4, 4)])
def test_document_masking_matches_one_process(cp, heads, kv_heads, mode):
    """Each query sees the keys of its own document up to itself (model.attention_mask=document), on cp
    ranks whose documents cross chunk and rank boundaries, against SDPA with the document mask on the whole sequence
    (float64: only the order of the sums differs, as above)."""
    results = dict(run_distributed(_document_worker, cp, cp, heads, kv_heads, mode))
    q, k, v, grad_out = make_inputs(heads, kv_heads, torch.float64)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    positions = packed_documents()
    documents = positions.eq(0).long().cumsum(1)   # a new document where its positions restart
    expected = SDPA()(q, k, v, None, Documents(documents, positions))
    expected.backward(grad_out)
    for i, want in enumerate((expected.detach(), q.grad, k.grad, v.grad)):
        got = zigzag_gather([torch.from_numpy(results[r][i]) for r in range(cp)], dim=2)
        torch.testing.assert_close(got, want, **tolerance(torch.float64))
