"""What the tests share: factories, waits and small servers, imported by test modules and conftest.py.

A test module imports from here (or uses a fixture from a conftest.py), never from another
test module. Fixtures live in tests/conftest.py; plain functions and classes live here:

- `waiting`: `wait_until(condition, timeout, what=...)`, the one poll with a deadline.
- `factories`: rows as a test wants them (`add_model`, `add_replica`, `add_node`) and
  request bodies (`new_model`).
- `gateway`: a client of the /v1/ gateway (`client`, `until_routed`, `chat`, `error_of`, ...).
- `engines`: the supervisor's reports and steps, and the vLLM stand-in.
- `mirror`: `put`, files copied into a mirror by hand.
- `fleet`: tasks as the control plane sends them and sees them (`send_fetch`, `sent`, `live`).
- `servers`: `LoopbackServer`, a small real HTTP server that answers as a test says.

The processes a test starts (tests/processes.py, tests/fleet_netns.py) are to move here too.
"""
