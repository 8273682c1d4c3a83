# Reported on every heartbeat, so staff can see which nodes run an older agent.
from contracts.version import VERSION as __version__  # noqa: F401
