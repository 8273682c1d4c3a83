from django.conf import settings
from django.core.checks import Error, register


@register()
def mirror_root_is_usable(app_configs, **kwargs):
    root = settings.MIRROR_ROOT
    if root.exists() and not root.is_dir():
        return [Error(f"LLMGW_MIRROR_ROOT is {root}, which is a file, not a directory.", id="mirror.E001")]
    if not settings.BYTES_URL.startswith(("http://", "https://")):
        return [
            Error(
                f"LLMGW_BYTES_URL must be an http:// or https:// address, not {settings.BYTES_URL!r}.", id="mirror.E002"
            )
        ]
    return []
