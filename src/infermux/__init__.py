"""infermux: get the most inference throughput out of every accelerator a machine has."""

from infermux.errors import InfermuxError, RunError, UsageError

__version__ = "0.1.0"

__all__ = ["InfermuxError", "RunError", "UsageError", "__version__"]
