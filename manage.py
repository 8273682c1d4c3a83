#!/usr/bin/env python
import os
import sys

# A node's commands: they run with the node's settings, which need neither a database nor
# any of the control plane's packages, whatever the environment they were started from says.
NODE_COMMANDS = ("agent", "fetch")


def main() -> None:
    if sys.argv[1:] == ["--version"]:
        from django import get_version

        from contracts.version import VERSION

        print(f"llmgw {VERSION} (Django {get_version()})")  # llmgw's release first: CHANGELOG.md names it
        return
    if sys.argv[1:2] and sys.argv[1] in NODE_COMMANDS:
        os.environ["DJANGO_SETTINGS_MODULE"] = "agent.settings"
        os.environ.pop("LLMGW_ROLE", None)  # the control plane's switch; a node has none
    else:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line

    from contracts.env import SettingError

    try:
        settings.INSTALLED_APPS  # noqa: B018 - read the settings now, where a wrong value can be said plainly
    except (ImproperlyConfigured, SettingError) as error:
        sys.exit(f"llmgw cannot start: {error}")
    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
