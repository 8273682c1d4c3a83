# Reported on every heartbeat, so staff can see which nodes run an older agent.
__version__ = "0.1.0"
