"""The node-level entry point every target starts: `python -m trainer.launch`.

It turns what a node sees (the scheduler's variables plus the `DDPKIT_*` ones a renderer sets,
docs/CONTRACT.md) into one torchrun invocation, or, in Slurm srun-per-GPU mode, into the six
per-worker variables `trainer.dist` reads. Four parts, each its own module:

- plan.py: pure, the environment in, torchrun's argv and the workers' environment out; which
  variable carries which fact in which context is a table (`CONTEXTS`).
- node.py: the launcher's `main`: the job file's settings, the node's CPUs, the wait for the
  master, then supervise.py or an exec.
- supervise.py: torchrun as a child, stop signals, stop exit codes, the launcher's half of warm
  restarts (the node's template process).
- relay.py: whole, tagged lines where a context's nodes share one output file.

This package's own module imports nothing: `from trainer.launch.plan import ...` stays light.
"""
