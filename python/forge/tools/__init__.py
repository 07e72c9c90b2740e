"""forge.tools — the programs built on the library: forge-train (train.py) and forge-bench
(bench.py), with the models, data and profiling they use. The library (forge.optim,
forge.lean, forge.graphs) never imports anything from here."""
