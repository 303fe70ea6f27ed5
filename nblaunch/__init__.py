"""nblaunch: distributed PyTorch training as one call from a notebook cell."""
from .errors import LaunchError, RankFailure, WorkerError
from .launcher import notebook_launcher
from .supervisor import LaunchTimeout

__all__ = ["notebook_launcher", "LaunchError", "WorkerError", "LaunchTimeout", "RankFailure"]
__version__ = "0.1.0"
