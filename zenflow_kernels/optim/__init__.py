"""ZenFlow, ZenFlowAdamW and their parts (docs/hacking.md): ``optimizer.py`` the torch ``Optimizer`` facade;
``selection.py``, ``fast_path.py``, ``interval.py`` with ``sums.py``, ``checkpoint.py``, ``telemetry.py`` the parts;
``run.py`` what they share; ``build.py`` and ``step_inputs.py`` the set-up and a step's inputs."""

from ..link.worker import HostWorkerError
from .optimizer import ZenFlow
from .zenflow_adamw import ZenFlowAdamW

__all__ = ["ZenFlow", "ZenFlowAdamW", "HostWorkerError"]
