"""How an adopted plan's stages map to spans of decoder blocks (pure)."""

import itertools

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.node.serve.layout import serving_route, serving_spans, span_of


@pytest.mark.parametrize(("layers", "stages"), [(0, 1), (4, 0), (-1, 2)])
def test_spans_refuse_nonsense(layers, stages):
    with pytest.raises(ConfigError):
        serving_spans(layers, stages)


@pytest.mark.parametrize(("layers", "stages"), [(1, 1), (7, 3), (8, 4), (3, 5), (32, 5)])
def test_spans_cover_every_block_once_in_order_and_evenly(layers, stages):
    spans = serving_spans(layers, stages)
    assert len(spans) == min(layers, stages)
    assert spans[0][0] == 0
    assert spans[-1][1] == layers
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    sizes = [b - a for a, b in spans]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the earlier stages take the extra blocks


def test_surplus_stages_merge_into_the_last_span_and_backups_fill_the_thinnest():
    route = serving_route([("a",), ("b", "c"), ("d",)], layers=2, backup=("z", "a", "y"))
    assert [(s.start, s.stop) for s in route] == [(0, 1), (1, 2)]
    # "a" is seated already; "y" and "z" (sorted) each join the stage with fewest replicas
    assert [s.peers for s in route] == [("a", "y", "z"), ("b", "c", "d")]
    assert span_of(route, "d").index == 1
    assert span_of(route, "nobody") is None
