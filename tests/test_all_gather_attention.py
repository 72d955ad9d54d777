"""All-gather context-parallel attention (nanoexp/parallel/context_parallel/all_gather.py) against full-sequence
causal attention, with the inputs, reference and tolerances of tests/test_ring_attention.py.

It runs on cp forked gloo ranks; output and q/k/v gradients, gathered back to the full sequence, are compared
with SDPA's (is_causal=True) on one process. Every collective is recorded: exactly one all-gather of the
stacked K/V forward and one reduce-scatter of the float32-or-wider dK/dV backward, no point-to-point call.
"""
from __future__ import annotations

import pytest
import torch

from nanoexp.parallel.context_parallel.all_gather import gather_blocks
from nanoexp.parallel.context_parallel.ring import visibility
from nanoexp.parallel.context_parallel.zigzag import rank_chunks
from tests.distributed import run_distributed
from tests.test_ring_attention import (BATCH, CASES, HEAD_DIM, SEQ, _cp_worker, assert_bf16_as_close_as_sdpa,
                                       compare_to_reference, score_elements)

# compare_to_reference uses the ring's tolerances (float64 1e-12, float32 1e-5): only the order of the softmax sums
# differs from SDPA here too. Measured worst cases over CASES, cp 2 and 4 (values and gradients up to ~5):
# float64 3.1e-15, float32 2.4e-6, as for the ring.


def test_gather_blocks_cover_the_causal_triangle_once_with_equal_work():
    """Every visible pair of chunks is computed exactly once, by the rank holding its queries, and every rank
    computes 1/cp of the causal triangle's scores."""
    chunk = 16
    for cp in range(1, 9):
        pairs, work = [], []
        for r in range(cp):
            blocks = gather_blocks(cp, r)
            assert sorted(blocks) == list(range(cp))
            pairs += [(rank_chunks(cp, r)[qi], rank_chunks(cp, source)[ki], causal)
                      for source, bs in blocks.items() for qi, ki, causal in bs]
            work.append(score_elements([b for bs in blocks.values() for b in bs], chunk))
        visible = [(q, k, visibility(q, k) == "causal") for q in range(2 * cp) for k in range(2 * cp) if k <= q]
        assert sorted(pairs) == sorted(visible)
        seq = 2 * cp * chunk
        assert work == [seq * (seq + 1) // 2 // cp] * cp


def expected_collectives(cp, kv_heads, dtype, group_name):
    """One all-gather of this rank's K and V stacked, one reduce-scatter to its dK/dV (float32 or wider)."""
    kv_floats = 2 * BATCH * kv_heads * (SEQ // cp) * HEAD_DIM
    element = torch.finfo(dtype).bits // 8
    return [("all_gather", group_name, kv_floats * element),
            ("reduce_scatter", group_name, kv_floats * max(element, 4))]


def kinds(posted):
    """all_gather_single / all_gather_into_tensor -> all_gather; the same for reduce-scatter (torch's names)."""
    return [(op.removesuffix("_single").removesuffix("_into_tensor").removesuffix("_tensor"), group, nbytes)
            for op, group, nbytes in posted]


@pytest.mark.parametrize("cp", [2, 4])
def test_all_gather_attention_matches_sdpa_with_one_gather_and_one_reduce_scatter(cp):
    results = dict(run_distributed(_cp_worker, cp, cp, CASES, None, "all_gather"))
    compare_to_reference(results, cp, CASES)
    for c, (heads, kv_heads, dtype, _) in enumerate(CASES):
        for r in range(cp):
            assert kinds(results[r][c][4]) == expected_collectives(cp, kv_heads, dtype, "world")
        # the ring's work on every rank: 1/cp of the causal triangle, forward
        assert [results[r][c][5] for r in range(cp)] == [BATCH * heads * SEQ * (SEQ + 1) // 2 // cp] * cp


def test_all_gather_attention_on_cp_subgroups():
    """World 4 as two cp=2 groups of non-neighbouring ranks (0, 2) and (1, 3), as a dp × cp grid would make:
    the collectives run on the group given, never on the world."""
    cases = CASES[1:3]
    results = run_distributed(_cp_worker, 4, 2, cases, [[0, 2], [1, 3]], "all_gather")
    for members in ([0, 2], [1, 3]):
        compare_to_reference({results[g][0]: results[g][1] for g in members}, 2, cases)
    for _, per_case in results:
        for (heads, kv_heads, dtype, _), result in zip(cases, per_case):
            assert kinds(result[4]) == expected_collectives(2, kv_heads, dtype, "cp")


def test_bfloat16_is_as_close_to_exact_as_sdpa():
    """In bfloat16 (float32 statistics and accumulators), cp=4: K/V are gathered in bf16 (2 bytes a float),
    dK/dV reduce-scattered in float32 (4 bytes). The cp=1 and document-masking tests of both cp modes are in
    tests/test_ring_attention.py."""
    heads, kv_heads, cp = 4, 2, 4
    results = dict(run_distributed(_cp_worker, cp, cp, [(heads, kv_heads, torch.bfloat16, None)], None, "all_gather"))
    assert_bf16_as_close_as_sdpa(results, heads, kv_heads, cp)
    for r in range(cp):
        assert kinds(results[r][0][4]) == expected_collectives(cp, kv_heads, torch.bfloat16, "world")
