"""The batching tuner: latency profiles, arrival traces, a batcher simulator and the search.

Pure: imports no kopf, no Kubernetes client and no torch (an import-linter contract holds
it to that), so ``batchpilot tune`` runs anywhere the operator's CLI does.
"""

from batchpilot_operator.tune.profile import LatencyProfile, ProfilePoint, load_profile
from batchpilot_operator.tune.search import SLOTargets, TuneResult, search
from batchpilot_operator.tune.simulator import LaneSettings, SimResult, Targets, simulate
from batchpilot_operator.tune.slo_check import meets_slo
from batchpilot_operator.tune.trace import Trace, load_trace

__all__ = [
    "LaneSettings",
    "LatencyProfile",
    "ProfilePoint",
    "SLOTargets",
    "SimResult",
    "Targets",
    "Trace",
    "TuneResult",
    "load_profile",
    "load_trace",
    "meets_slo",
    "search",
    "simulate",
]
