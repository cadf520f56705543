"""ddpkit's deployment side: the job model, renderers, submitters and the CLI.

Never imports torch; kubernetes and submitit are imported only by the commands that need them.
"""

__version__ = "0.1.0"
