"""``dptrain tune``: the configuration chosen for a job, from the calibrated simulator and a few short real runs.

- :mod:`~dptrain.tune.space`: the candidates (strategy and options, micro-batch x accumulation, bucket, codec);
- :mod:`~dptrain.tune.search`: prune by memory, rank by predicted step time, measure the best few;
- :mod:`~dptrain.tune.machine`: where probes and trials run (this machine, the emulated cluster, a launcher);
- :mod:`~dptrain.tune.calibrate`: the links and overheads of the machine, measured once and reused;
- :mod:`~dptrain.tune.trials`: one short real run of a candidate;
- :mod:`~dptrain.tune.tuner` and :mod:`~dptrain.tune.report`: the whole search and what it writes.
"""
