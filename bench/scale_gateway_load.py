"""bench/scale.py --jobs gateway-load: bench/gateway.py as it is, with few API keys in the database and with many."""

from __future__ import annotations

import subprocess
import sys

from harness import ROOT

__all__ = ["bench_gateway_load", "gateway_load_child"]


SEED_KEYS = """
from gateway.keys import hash_key
from gateway.models import ApiKey, TableChange
ApiKey.objects.bulk_create(
    (ApiKey(name=f"many-{i:06}", prefix="llmgw-many", key_hash=hash_key(f"many-{i}")) for i in range({n})),
    batch_size=2000,
)
TableChange.objects.all().delete()
"""


def gateway_load_child(keys: int, gateway_args: list[str]) -> None:
    """bench/gateway.py as it is, with `keys` more API keys written before llmgw's server starts."""
    import importlib.util

    from harness import Site

    start = Site.start

    def start_after_the_keys(site: Site, command: str | None = None, **settings: str):
        if command is None and keys:
            seeded = site.shell(SEED_KEYS.replace("{n}", str(keys)))
            if seeded.returncode:
                raise SystemExit(f"the keys could not be written:\n{seeded.stderr[-2000:]}")
        return start(site, command, **settings)

    Site.start = start_after_the_keys
    spec = importlib.util.spec_from_file_location("bench_gateway", ROOT / "bench" / "gateway.py")
    bench_gateway = importlib.util.module_from_spec(spec)
    sys.modules["bench_gateway"] = bench_gateway  # its dataclasses look their module up there
    spec.loader.exec_module(bench_gateway)
    sys.argv = ["gateway.py", "--no-litellm", *gateway_args]
    bench_gateway.main()


def bench_gateway_load(key_counts: list[int], gateway_args: list[str]) -> None:
    for keys in key_counts:
        print(f"\nbench/gateway.py, llmgw alone, with {keys:,} API keys in the database", flush=True)
        argv = [
            sys.executable,
            str(ROOT / "bench" / "scale.py"),
            "--gateway-load-child",
            str(keys - 1),
            "--",
            *gateway_args,
        ]
        subprocess.run(argv, check=True)
