"""Slurm: one SbatchRequest, laid out by the sbatch template and mapped by submitit."""
