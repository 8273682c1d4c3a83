"""The catalog's defaults, once: the model fields, the configuration file and the fleet's snapshots read these.

Plain numbers and no Django, so the placement's snapshots (fleet/snapshots.py) may
use them as well as the models.
"""

# A model's replicas: fewest and most, and how the count follows the load (fleet.autoscale).
SCALING_MIN = 1
SCALING_MAX = 1
TARGET_LOAD = 1  # requests in flight per ready replica before another is added
QUIET_S = 300  # how long the load stays below what the replicas serve before one is stopped
IDLE_S = 900  # with fewest 0: how long without a request before the last replica stops
PRIORITY = 100  # a model's, when room is made for another, and a profile's, lower tried first

# A profile's.
WEIGHT = 1
MIN_MEMORY_GB = 0
