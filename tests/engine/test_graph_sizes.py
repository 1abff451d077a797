"""Which captured decode graph a batch replays (kiln/engine/cuda_graphs.py): the smallest that
holds it, or a larger one that start-up timing found faster. The replays themselves run on the
GPU (tests/gpu/test_engine_gpu.py)."""

import pytest

from kiln.engine.cuda_graphs import batch_size_ladder, fastest_holding


def test_a_batch_goes_to_a_larger_graph_only_when_it_is_faster_by_the_margin():
    sizes = [256, 384, 448, 512]
    ms = {256: 11.0, 384: 15.0, 448: 21.5, 512: 20.0}  # cuBLAS slow at 448, as on the H100
    assert fastest_holding(sizes, ms) == {448: 512}  # 7% faster
    assert fastest_holding(sizes, ms, margin=0.1) == {}
    ms[384] = 22.0  # now both 384 and 448 run faster as 512
    assert fastest_holding(sizes, ms) == {384: 512, 448: 512}


def test_a_few_percent_faster_larger_graph_is_taken_and_a_tie_is_not():
    sizes = [272, 288, 320]
    # as int4's batches of 264-272 on the H100, which run faster on 320's graph (one x box)
    assert fastest_holding(sizes, {272: 10.3, 288: 10.4, 320: 10.0}) == {272: 320, 288: 320}
    assert fastest_holding(sizes, {272: 10.1, 288: 10.4, 320: 10.0}) == {288: 320}


def test_the_fastest_of_several_larger_graphs_is_taken():
    sizes = [8, 16, 24, 32]
    ms = {8: 3.0, 16: 2.0, 24: 1.5, 32: 2.5}
    assert fastest_holding(sizes, ms) == {8: 24, 16: 24}


def test_a_route_saving_microseconds_is_not_taken():
    """Timing noise must not decide which graph (and so which GEMM tiles) a batch runs: kiln-tiny's
    0.2 ms graphs, a larger one 4% faster by 7 us, keep their own."""
    sizes = [8, 16, 32]
    assert fastest_holding(sizes, {8: 0.183, 16: 0.190, 32: 0.176}) == {}
    assert fastest_holding(sizes, {8: 0.183, 16: 0.190, 32: 0.176}, min_saved_ms=0.005) == {
        8: 32, 16: 32}


@pytest.mark.parametrize("max_num_seqs", [1, 48, 256, 512, 1000])
def test_no_route_leaves_the_ladder_when_times_rise_with_size(max_num_seqs):
    sizes = batch_size_ladder(max_num_seqs)
    assert fastest_holding(sizes, {s: 1.0 + s / 100 for s in sizes}) == {}
