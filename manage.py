#!/usr/bin/env python
import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
    if sys.argv[1:2] in (["agent"], ["fetch"]):
        # The node's commands: the node's settings, which need neither a database nor
        # the control plane's packages.
        os.environ.setdefault("LLMGW_ROLE", "node")
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line

    try:
        settings.INSTALLED_APPS  # noqa: B018 - read the settings now, where a wrong value can be said plainly
    except ImproperlyConfigured as error:
        sys.exit(f"llmgw cannot start: {error}")
    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
