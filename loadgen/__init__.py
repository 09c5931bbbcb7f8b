"""Baton's load-test harness and cluster simulator.

* ``loadgen.client.run_bench(BenchConfig) -> BenchResult``: drive a live server.
* ``loadgen.sim.simulate(SimConfig) -> SimResult``: the same workload on a
  simulated cluster driving the real router.

Both return the same summary keys (vLLM ``bench serve`` names, see
``loadgen.metrics``). Submodules are imported on demand so ``baton bench``
does not pay for the simulator and vice versa.
"""
