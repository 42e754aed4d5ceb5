"""jaxpipe: pipeline parallelism for JAX, any schedule compiled into one XLA program."""

__version__ = "0.1.0"
