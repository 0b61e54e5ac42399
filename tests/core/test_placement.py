"""Byte-balanced placement, without a cluster."""

import pytest

from psclient._core.placement import Placer


def place_all(placer, sizes):
    out = []
    for i, nbytes in enumerate(sizes):
        k = placer.choose(nbytes)
        placer.record(f"v{i}", (nbytes // 4,), "float32", nbytes, k)
        out.append(k)
    return out


def test_kernel_bias_pairs_are_balanced_by_bytes_not_count():
    # Round robin would put every kernel on ps 0 and every bias on ps 1.
    kernel, bias = 784 * 512 * 4, 512 * 4
    placer = Placer(2)
    where = place_all(placer, [kernel, bias, kernel, bias, kernel, bias])
    assert where[0] != where[2]  # the second kernel goes to the other ps
    loads = placer.bytes_per_ps()
    assert max(loads) - min(loads) <= kernel
    assert max(loads) <= 2 * kernel + 3 * bias


def test_greedy_bound_holds_for_many_sizes():
    import random

    rng = random.Random(0)
    sizes = [rng.randint(1, 10_000) for _ in range(500)]
    placer = Placer(3)
    place_all(placer, sizes)
    loads = placer.bytes_per_ps()
    # Online greedy: the spread never exceeds the largest single item.
    assert max(loads) - min(loads) <= max(sizes)
    assert sum(loads) == sum(sizes)


def test_ties_go_to_lowest_index_and_requested_tasks_count():
    placer = Placer(3)
    assert placer.choose(10) == 0
    placer.record("slot", (10,), "float32", 40, 0, reason="requested")
    assert placer.choose(10) == 1


def test_report_lists_every_variable_and_bytes():
    placer = Placer(2)
    placer.record("w", (2, 3), "float32", 24, 1)
    report = placer.report()
    assert report["bytes_per_ps"] == [0, 24]
    assert report["variables"][0]["name"] == "w"
    assert report["variables"][0]["shape"] == (2, 3)
    assert report["variables"][0]["reason"] == "balanced"


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="num_ps"):
        Placer(0)
    with pytest.raises(ValueError, match="ps tasks 0..1"):
        Placer(2).record("v", (), "float32", 4, 5)
