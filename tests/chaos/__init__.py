"""The fault harness: randomized scenarios, replayable from a seed, checked against
invariants rather than examples (``docs/testing.rst``, section "The fault harness").

* :mod:`chaos.scenario`: a scenario and its fault schedule, drawn from a seed.
* :mod:`chaos.node`: one node process (a rendezvous handler driven like torchrun's agent).
* :mod:`chaos.runner`: carries a scenario out against real etcd and checks it.
* :mod:`chaos.records`: what the processes write down (JSON lines).
* :mod:`chaos.checker`: the invariants, a pure function of the records.
* :mod:`chaos.etcd_view`: the runner's own look at etcd over HTTP.
* :mod:`chaos.cli`: ``python -m tests.chaos``.
"""
