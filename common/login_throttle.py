"""The staff login's throttle: django-axes, with a sentence for the locked-out and no opinion on logins without a form.

After LLMGW_LOGIN_FAILURES wrong passwords for one username from one address, both are
refused for LLMGW_LOGIN_LOCKOUT_S, the right password too (docs/roles.md). The admin's
login is the one password form of the admin port; API tokens are not passwords.
"""

from __future__ import annotations

from axes.backends import AxesStandaloneBackend
from django.conf import settings
from django.http import HttpResponse


class LoginThrottle(AxesStandaloneBackend):
    """django-axes' check, for the logins that come from a request.

    A login without one (a management command, a test client's `login()`) comes from no
    form and no address: axes would raise; it is no one's guess to throttle, so it passes on.
    """

    def authenticate(self, request, username=None, password=None, **kwargs):
        if request is None:
            return None
        return super().authenticate(request, username, password, **kwargs)


def locked_out(request, original_response=None, credentials=None) -> HttpResponse:
    minutes = max(1, round(settings.LOGIN_LOCKOUT_S / 60))
    return HttpResponse(
        f"Too many failed logins for this username from this address ({settings.LOGIN_FAILURES}): "
        f"logins are refused for {minutes} minute(s) from the last try, the right password too. "
        "An administrator can lift it sooner with `manage.py axes_reset`.\n",
        status=429,
        content_type="text/plain; charset=utf-8",
    )
