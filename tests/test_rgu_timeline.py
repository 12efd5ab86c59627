"""scripts/rgu_timeline.py's summary of the measurement build's stamps (the GPU run itself needs a library
built with -DTM_RGU_TIMELINE=1; here the rows are written by hand, in the layout csrc/cuda/rgu_timeline.cuh
documents)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import load_script


def test_summary_times_each_role_from_the_first_block() -> None:
    tl = load_script("rgu_timeline")
    base = 5 * 10**12  # the global timer in ns
    blocks = [(0, [0, 100, 200, 1500, 6000]), (1, [50, 150, 150, 900, 4000]), (1, [60, 160, 160, 950, 4200]),
              (2, [70, 170, 300, 6100, 9000]), (2, [4000, 4100, 4200, 6200, 9500]),
              (3, [8000, 9800, 11500, 10900, 12000]),  # a block of the down launch: wait, routed, shared dots
              (4, [1600, 2500, 3000, 3400, 3500])]  # the top-k's steps
    rows = np.zeros(len(blocks) + 2, dtype=tl.ROW)  # two rows no block stamped
    for i, (role, t) in enumerate(blocks):
        rows[i]["t"] = [base + x for x in t]
        rows[i]["role"], rows[i]["sm"] = role, 7
    assert tl.ROW.itemsize == 48  # rgu_timeline.cuh's TimelineRow
    s = tl.summarize(rows[rows["t"][:, 0] > 0])
    assert s["blocks"] == 5 and s["span_us"] == pytest.approx(9.5)  # the gate-up launch's, without the down
    assert s["topk"] == pytest.approx([1.6, 2.5, 3.0, 3.4, 3.5])
    # at 4 us: the router block, the second shared one and both routed ones (the second starts at 4.0) are
    # resident, the first shared one has just ended; of them the router and shared blocks have inputs
    assert s["occupancy"][4] == [4.0, 4, 2] and s["occupancy"][0] == [0.0, 1, 0] and len(s["occupancy"]) == 10
    assert s["down"]["blocks"] == 1 and s["down"]["after_wait"] == pytest.approx([9.8] * 3)
    assert s["down"]["routed_dots"] == pytest.approx([11.5] * 3)  # the down's own events, not a role's
    assert s["down"]["routed_dots_us_median"] == pytest.approx(1.7)
    assert s["down"]["shared_dots_us_median"] == pytest.approx(1.1)
    assert s["down"]["epilogue_us_median"] == pytest.approx(0.5)
    assert "waiting_us_median" not in s["down"]
    assert s["router"]["end"] == pytest.approx([6.0, 6.0, 6.0])
    assert s["shared"]["blocks"] == 2 and s["shared"]["inputs_ready"] == pytest.approx([0.9, 0.925, 0.95])
    assert s["routed"]["waiting_us_median"] == pytest.approx((5.8 + 2.0) / 2)
    assert s["routed_started_before_the_ids"] == 2


def test_weight_stream_spreads_each_blocks_bytes_over_its_streaming() -> None:
    tl = load_script("rgu_timeline")
    base = 5 * 10**12
    # shared blocks stream 1.0 -> 3.0 us and (no inputs stamp: from its wait) 2.0 -> 4.0, a routed one 2.5 ->
    # 3.5; a router block: its span counts, its bytes do not
    blocks = [(1, [0, 500, 600, 1000, 3000]), (1, [0, 2000, 2000, None, 4000]),
              (2, [100, 200, 300, 2500, 3500]), (0, [0, 100, 200, 300, 9000])]
    rows = np.zeros(len(blocks), dtype=tl.ROW)
    for i, (role, t) in enumerate(blocks):
        rows[i]["t"] = [0 if x is None else base + x for x in t]
        rows[i]["role"] = role
    mb = 10**6  # a block's bytes: 1 MB, so that 1 MB in 1 us reads 1.0 TB/s
    rate = dict(tl.summarize(rows, block_bytes=mb)["weight_tb_s"])
    assert sorted(rate) == [float(x) for x in range(9)]
    assert rate[0.0] == 0.0 and rate[1.0] == pytest.approx(0.5)
    assert rate[2.0] == pytest.approx(0.5 + 0.5 + 0.5)  # both shared blocks and the routed one's first half
    assert rate[3.0] == pytest.approx(0.5 + 0.5)  # the second shared block and the routed one's second half
    assert sum(rate.values()) == pytest.approx(3.0)  # every block's bytes, once
    assert "weight_tb_s" not in tl.summarize(rows)
