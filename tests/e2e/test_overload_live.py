"""Goodput past saturation, live: ``baton serve`` with 2 prefill + 2 decode workers (Ray
actors, a random 53M-parameter Llama, ``slo_goodput``, the rebalancer off), swept over
open-loop rates to find where it saturates, then offered 2x and 3x that rate (eight
30 s runs each, in rounds with eight more runs at the peak's rate, each round on
arrivals of its own), all in this test. It runs ``benchmarks/overload.py``'s
``measure`` as ``make bench-overload`` does: the same server, workload, SLO (scaled to
the host's speed) and sweep.

Each run's goodput is the requests sent in its window that met the SLO per second
(``loadgen.overload.window_goodput``); a factor's is the mean of its eight runs, the
peak's the mean of the eight runs again at the rate of the sweep's best run (not that
run, picked for reading high: ``loadgen.overload.peak_goodput``). Past saturation the router must refuse what it
cannot serve, so the admitted requests keep their targets: goodput stays within 90% of
the sweep's peak, every refusal is a 429 answered within 50 ms (times the host's
slowdown, as the SLO is: ``refusal_bound_ms``), and nothing fails otherwise. The router refuses at once (``max_hold_s: 0``): a held request that finds no
room is refused when its hold runs out, up to 1.8 s later on 2 AVX-512 cores.

Measured on 2 AVX-512 cores (saturation 7.6 req/s, peak 9.2-9.6 good req/s), 2x held
0.93-1.05 of peak and 3x 0.96-1.08 over seven runs, refusals 12-24 ms. On a slower
host (stood in for with a CPU quota of 0.6 core, saturation 2.25 req/s) prefill steps
slowed 2-4x from one step to the next while decode batches took the shared cores, and
the prompts admitted into a slow step missed together; prefill engines now run at a
lower nice value than decode ones (``workers.prefill_nice``), and the stand-in read
1.03 of peak at 2x and 0.86 at 3x in its last run (its quota also slows the client's
and the gateway's HTTP work, which a host with slower arithmetic does not).

On 2 slower AVX-512 cores (saturation 5.06 req/s, peak about 6.2 good req/s) a single
run at each factor failed the bound in two of two tries (0.86 at 2x; 0.88 at 3x),
though the means are level there: eleven 30 s runs at 15.2 req/s (3x) read 5.57-7.17
good req/s, mean 6.3, against 6.0-6.4 at 7.6 and 10.1 req/s. Hence several runs each.
With three each, and the sweep's best run in the peak's mean, one clean-clone CI run in
seven failed there: 2x read 0.89 of a peak of 5.26 good req/s (its runs 4.77, 4.37 and
4.93), 0.92 of the peak's three runs alone (5.12). Five runs narrow a mean's swing by
a further 1.3 (the test takes about 4 minutes more).

Five runs each failed once more in a clean-clone CI run: 2x read 0.897 of the peak
(5.05 against 5.63 good req/s). Two things made that reading low, both mended in
``loadgen.overload``. A run's arrivals follow from the workload's seed and its rate, so
the runs again at the sweep's best rate repeated the easy trace the sweep had picked it
for: here, on one host, they read 6.0-6.17 good req/s, and 2x, at nearly the peak's rate
(11.21 against 11.39 req/s) on arrivals of its own, 4.63-5.9 (0.895). Each round now
draws arrivals of its own. And the climb had served 3.375 req/s and kept 81% at 5.06,
so 2x (6.75 req/s) lay as little as 1.33x past the knee, where goodput was still
creeping up: two refining runs now put the saturation rate within 11% of the knee.
With both, on this host: the peak 5.50 good req/s (its runs 4.97-6.23, the sweep's
best run 6.3), 2x 0.96 and 3x 1.07 of it (931 s). A run on fresh arrivals swings by
about 9%, so a ratio of five-run means by about 6.5%: eight runs each bring that to
about 5% (the test takes about 5 minutes more)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.scripts import load_script
from loadgen.server_proc import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2100)]


def test_goodput_at_2x_and_3x_saturation_holds_90_percent_of_peak_with_quick_refusals(
    tmp_path: Path,
) -> None:
    bench = load_script(ROOT / "benchmarks" / "overload.py", "bench_overload")
    # make bench-overload's defaults (2 prefill + 2 decode, the 53M model, slo_goodput,
    # SLO scaled to the host, a climbing sweep, 30 s windows), refusing at once; the sweep
    # climbs from 1 req/s, as in every CI run before the benchmark's default became
    # ``--start-rate auto``: in one of three clean-clone CI runs starting at 3.375 req/s,
    # one refusal of 394 at 3x took 73 ms (p99 17 ms), and whether the shorter history
    # before the overloaded runs is why is not known. The 2x and 3x windows are as long as
    # the sweep's (30 s): tried at 60 s, they read 0.89 of the peak in a CI run (8.33 and
    # 8.35 good req/s against 9.4 and 9.27 for the peak's two 30 s runs), probably because
    # a run starts on a settled cluster and its easy first seconds weigh less in a longer
    # window.
    args = bench.parser().parse_args(["--max-hold", "0", "--start-rate", "1", "--repeats", "8"])
    result = bench.measure(args, tmp_path)

    sweep, peak = result["sweep"], result["peak_goodput"]
    assert sweep[0]["slo_attainment"] >= 0.95, sweep[0]  # the lowest rate is served
    assert sweep[-1]["window_goodput"] < 0.9 * sweep[-1]["rate"], sweep  # past saturation
    assert [row["factor"] for row in result["over"]] == [2.0, 3.0]
    for row in result["over"]:
        assert row["rejected"] > 0, row  # overloaded, and it refuses
        # Every failure is a refusal (429), or the 400 of a prompt past the model's length
        # (the lognormal prompts' tail reaches it now and then at these rates).
        too_long = sum(n for e, n in row["errors"].items() if "maximum context length" in e)
        assert row["failed"] == row["rejected"] + too_long, row
        assert row["of_peak"] >= 0.9, (peak, result["saturation_rate"], row)
        assert row["max_rejection_ms"] < result["refusal_bound_ms"], (result["host_slowdown"], row)
