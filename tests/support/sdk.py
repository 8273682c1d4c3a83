"""The official `openai` and `anthropic` clients, imported when a test first uses one.

Every xdist worker imports every test module at collection, the tests it will not run
included: `import anthropic` took 1.3 s and `import openai` 0.5 s of CPU in each of
`make test-fast`'s four workers, for tests of the other tier. `openai.OpenAI(...)`,
`pytest.raises(anthropic.RateLimitError)` and the like read the real module at the call.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class _Imported:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str):
        if attribute.startswith("_"):
            # pytest's collection asks every name of a test module for markers and fixtures: not an import.
            raise AttributeError(attribute)
        module: ModuleType = importlib.import_module(self._name)
        return getattr(module, attribute)


openai = _Imported("openai")
anthropic = _Imported("anthropic")
