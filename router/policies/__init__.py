"""Built-in routing policies; importing this package registers them by name.

``round_robin`` and ``least_loaded`` are baselines, ``prefix_aware`` follows
cached prefixes, ``slo_goodput`` (the default) places for goodput.
"""

from router.policies.least_loaded import LeastLoaded
from router.policies.prefix_aware import PrefixAware
from router.policies.round_robin import RoundRobin
from router.policies.slo_goodput import SloGoodput

__all__ = ["LeastLoaded", "PrefixAware", "RoundRobin", "SloGoodput"]
