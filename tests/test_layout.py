"""Layout: every number a layout implies, computed once from the config."""
import pytest

from nanoexp.parallel.layout import Layout, split_layers
from tests.helpers import compose_config


def test_from_config_reads_the_parallelism_group():
    cfg = compose_config(["parallelism=dp1cp2tp2pp2", "parallelism.tp_mode=reduce_scatter",
                          "parallelism.pp_engine=interleaved_1f1b", "parallelism.pp_virtual_stages=2",
                          "parallelism.cp_mode=all_gather"])
    layout = Layout.from_config(cfg)
    assert layout == Layout(dp=1, cp=2, tp=2, pp=2, schedule="interleaved_1f1b", virtual_stages=2,
                            cp_mode="all_gather", sequence_parallel=True)
    assert (layout.world_size, layout.dp_cp, layout.name) == (8, 2, "dp1cp2tp2pp2")
    assert Layout(dp=2, tp=2, pp=2).name == "dp2tp2pp2"   # cp is named only when used


def test_stage_layers_with_and_without_virtual_stages():
    assert [Layout(pp=2).stage_layers(5, r) for r in range(2)] == [[range(0, 3)], [range(3, 5)]]
    # 8 layers in pp·v = 4 virtual stages: chunk c of pp rank r is virtual stage c·pp + r
    interleaved = Layout(pp=2, schedule="interleaved_1f1b", virtual_stages=2)
    assert [interleaved.stage_layers(8, r) for r in range(2)] == [[range(0, 2), range(4, 6)],
                                                                   [range(2, 4), range(6, 8)]]
    with pytest.raises(ValueError, match="every stage needs at least one layer"):
        interleaved.stage_layers(3, 0)


def test_split_layers():
    assert split_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert split_layers(5, 1) == [range(0, 5)]
    for n, pp in [(7, 3), (13, 5), (4, 4)]:
        sizes = [len(r) for r in split_layers(n, pp)]
        assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes, reverse=True)  # earlier stages get the extra layers
    with pytest.raises(ValueError):
        split_layers(3, 4)
    with pytest.raises(ValueError):
        split_layers(3, 0)


def test_activation_shape_between_stages():
    assert Layout(pp=2).activation_shape(4, 128, 96) == (4, 128, 96)
    assert Layout(cp=2, pp=2).activation_shape(4, 128, 96) == (4, 64, 96)               # s / cp
    assert Layout(cp=2, tp=2, pp=2, sequence_parallel=True).activation_shape(4, 128, 96) == (4, 32, 96)   # / tp
    assert Layout(tp=2, pp=2).activation_shape(4, 128, 96) == (4, 128, 96)             # replicated over tp


def test_tied_embeddings_live_where_the_layout_says():
    one_stage, two_stages = Layout(), Layout(pp=2)
    assert one_stage.lm_head_weight(0, tied=True) == "embedding" and one_stage.lm_head_weight(0, tied=False) == "own"
    assert two_stages.lm_head_weight(0, tied=True) is None   # no head on the first stage
    assert two_stages.lm_head_weight(1, tied=True) == "copy"
    assert two_stages.embedding_has_copy(0, tied=True) and not one_stage.embedding_has_copy(0, tied=True)
    assert not two_stages.embedding_has_copy(0, tied=False)
    assert two_stages.tied_stages == (0, 1) and Layout(pp=4).tied_stages == (0, 3) and one_stage.tied_stages == (0,)


def test_the_trainer_refuses_a_context_of_another_layout():
    import os

    from nanoexp.parallel.context import ParallelContext
    from nanoexp.runtime.trainer import Trainer
    cfg = compose_config(["parallelism.tp_mode=reduce_scatter"])   # sequence parallel, one process
    with pytest.raises(ValueError, match="is not the config's"):
        Trainer(cfg, ParallelContext(), os.devnull)


def test_the_rank_grid_has_tp_innermost_and_round_trips():
    layout = Layout(dp=2, cp=3, tp=2, pp=2)
    assert [layout.position(r) for r in (0, 1, 2, 6, 12)] == [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0),
                                                               (1, 0, 0, 0)]
    assert all(layout.rank_at(*layout.position(r)) == r for r in range(layout.world_size))


def test_tp_and_cp_groups_that_cross_nodes_are_named():
    assert Layout(dp=2, tp=2, pp=2).dims_crossing_nodes(2) == []           # tp pairs: one per node
    assert Layout(dp=2, tp=4).dims_crossing_nodes(2) == ["tp"]             # a tp group over two nodes
    assert Layout(dp=2, tp=2).dims_crossing_nodes(3) == ["tp"]             # ranks 2,3 straddle nodes 0 and 1
    assert Layout(cp=2, tp=2, pp=2).dims_crossing_nodes(4) == []
    assert Layout(cp=2, tp=2, pp=2).dims_crossing_nodes(2) == ["cp"]       # tp inside, the cp ring across
    assert Layout(dp=8, tp=4).dims_crossing_nodes(32) == []                # one node holds everything


def test_launcher_warnings_name_the_key_and_none_is_about_torchrun_restarts(monkeypatch):
    from nanoexp.run import launcher_warnings
    # Plain torchrun --max-restarts recovers (nanoexp.launch.rendezvous): its shared store is nothing to warn about.
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert launcher_warnings(Layout(dp=2, tp=2), 2) == []
    (tp_warning,) = launcher_warnings(Layout(dp=1, tp=4), 2)
    assert tp_warning.startswith("parallelism.tp=4 spans nodes of 2 ranks")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in tp_warning
