"""samebits.tools.timeline: busy time as a union, gaps charged to the innermost open host range."""

from samebits.tools.timeline import OUTSIDE, bucket, gaps, idle_report, merged, open_ranges


def test_overlapping_kernels_count_once_and_leave_the_gaps_between_them():
    busy = merged([(0, 10), (5, 12), (20, 25), (25, 30), (40, 41)])
    assert busy == [(0, 12), (20, 30), (40, 41)]
    assert gaps(busy) == [(12, 20), (30, 40)]


def test_a_gap_is_charged_to_the_innermost_range_open_at_its_start():
    ranges = [("step", 0, 100), ("forward", 10, 50), ("sample", 60, 90), ("schedule", 120, 130)]
    assert open_ranges(ranges, [5, 20, 55, 70, 95, 110, 125, 140]) == [
        "step", "forward", "step", "sample", "step", OUTSIDE, "schedule", OUTSIDE]


def test_idle_report_sums_gaps_by_host_part_and_size():
    kernels = [(0, 10), (15, 20), (520, 530), (2600, 2610)]
    ranges = [("forward", 0, 12), ("sample", 400, 3000)]
    report = idle_report(kernels, ranges)
    assert report["busy"] == 35 and report["span"] == 2610 and report["idle"] == 2575
    assert report["idle_by_host"] == {"forward": {"total": 5, "count": 1},
                                      OUTSIDE: {"total": 500, "count": 1},
                                      "sample": {"total": 2070, "count": 1}}
    assert report["idle_by_size"] == {"lt10": {"total": 5, "count": 1},
                                      "lt1000": {"total": 500, "count": 1},
                                      "ge1000": {"total": 2070, "count": 1}}
    assert [bucket(s) for s in (9.9, 10, 99, 100, 999, 1000)] == [
        "lt10", "lt100", "lt100", "lt1000", "lt1000", "ge1000"]
    assert idle_report([], ranges)["busy"] == 0.0
